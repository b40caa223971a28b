"""The training rewards of a rollout: what advantages are computed from, next to the raw rewards that are logged.

`--custom-reward-post-process-path fn(args, samples) -> (raw_rewards, rewards)` replaces everything here
(`rollout_rewards`; the samples' rewards may then be anything the reward function returned, e.g. on-policy
distillation's teacher answers, slime.rollout.on_policy_distillation). Otherwise the estimator's record decides
(slime/algorithm/estimators.py): estimators that compare the samples of a prompt with each other
(`group_normalized`) get each reward minus its group's mean, divided by the group's std when the record says so
(`divide_by_std`) and `--disable-grpo-std-normalization` (Dr.GRPO) is not given; `--disable-rewards-normalization`
keeps the raw rewards. Groups are formed by `group_index`, not position.
"""

from __future__ import annotations

from typing import Any

from slime.algorithm.estimators import estimator_of
from slime.algorithm.returns import group_normalize_rewards
from slime.utils.hooks import hooks_of
from slime.utils.types import Sample


def rollout_rewards(args: Any, samples: list[Sample], group_indices: list[int]) -> tuple[list[float], list[float]]:
    """(raw rewards, training rewards) of the rollout's samples: the post-process's when one is given (slime's),
    else each sample's reward value (`--reward-key`) and `train_rewards` of them."""
    path = args.custom_reward_post_process_path
    if not path:
        raw = [s.scalar_reward(args.reward_key) for s in samples]
        return raw, train_rewards(args, samples, raw, group_indices)
    out = hooks_of(args).custom_reward_post_process(args, samples)
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(hasattr(x, "__len__") and len(x) == len(samples) for x in out)):
        raise ValueError(f"--custom-reward-post-process-path {path}: slime's contract returns (raw_rewards, rewards), "
                         f"one entry per sample ({len(samples)}); got {type(out).__name__}")
    return [float(r) for r in out[0]], [float(r) for r in out[1]]


def train_rewards(args: Any, samples: list[Sample], raw: list[float], group_indices: list[int]) -> list[float]:
    """The estimator's rewards of the raw rewards (the default of `rollout_rewards`)."""
    estimator = estimator_of(args)
    if not estimator.group_normalized or args.disable_rewards_normalization:
        return list(raw)
    std_normalize = estimator.divide_by_std and not args.disable_grpo_std_normalization
    return [float(r) for r in group_normalize_rewards(raw, group_indices, std_normalize)]
