"""The training rewards of a rollout: what advantages are computed from, next to the raw rewards that are logged.

`--custom-reward-post-process-path fn(args, samples) -> (raw_rewards, rewards)` replaces everything here.
Otherwise the estimator's record decides (slime/algorithm/estimators.py): estimators that compare the samples of
a prompt with each other (`group_normalized`) get each reward minus its group's mean, divided by the group's std
when the record says so (`divide_by_std`) and `--disable-grpo-std-normalization` (Dr.GRPO) is not given;
`--disable-rewards-normalization` keeps the raw rewards. Groups are formed by `group_index`, not position.
"""

from __future__ import annotations

from typing import Any

from slime.algorithm.estimators import estimator_of
from slime.utils.misc import load_function
from slime.utils.ppo_utils import group_normalize_rewards
from slime.utils.types import Sample


def train_rewards(args: Any, samples: list[Sample], raw: list[float], group_indices: list[int]) -> list[float]:
    if args.custom_reward_post_process_path:
        _, rewards = load_function(args.custom_reward_post_process_path, "--custom-reward-post-process-path")(
            args, samples)
        return [float(r) for r in rewards]
    estimator = estimator_of(args)
    if not estimator.group_normalized or args.disable_rewards_normalization:
        return list(raw)
    std_normalize = estimator.divide_by_std and not args.disable_grpo_std_normalization
    return [float(r) for r in group_normalize_rewards(raw, group_indices, std_normalize)]
