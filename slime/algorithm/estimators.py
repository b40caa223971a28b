"""The advantage estimators (`--advantage-estimator`): one record per name, and the one place to add one.

Everything that depends on the estimator reads its record: the parser's choices, the reward normalisation of
the rollout (`group_normalized`, `divide_by_std`), the advantage and return computation (`advantages`), the
policy loss (`policy_loss`), whether a PPO critic is trained next to the policy (`needs_critic`) and whether
`--normalize-advantages` is required (`whitens`). Adding an estimator = one `Estimator(...)` in `ESTIMATORS`.

The math is in slime/utils/ppo_utils.py (pure functions with closed-form tests); the records only wire it.
`compute_advantages_and_returns` also honours `--custom-advantage-function-path`, which replaces the
record's `advantages` for any estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slime.utils import ppo_utils
from slime.utils.misc import load_function

Tensors = list[torch.Tensor]


@dataclass
class AdvantageInputs:
    """Everything an advantage estimator may use, for the rows one rank trains on (one entry per row).

    This is also the contract of `--custom-advantage-function-path fn(args, inputs) -> (advantages,
    returns)`, both lists of [T_i] fp32 tensors (returns may be None where no critic needs them)."""

    rewards: list[float]  # the rollout's training rewards (group-normalised when the estimator says so)
    raw_rewards: list[float]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]  # [T_i] 0/1
    group_indices: list[int]
    kl: list[torch.Tensor] | None = None  # [T_i] KL(old policy || reference), when a reference model runs
    values: list[torch.Tensor] | None = None  # [T_i] critic values (ppo)


# (args, inputs) -> (advantages, returns or None), per row
AdvantageFn = Callable[[Any, AdvantageInputs], tuple[Tensors, Tensors | None]]
# (log_probs, old_log_probs, advantages, mask, args) -> per-token (pg_losses, clipfrac, ppo_kl), all [B, R]
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any],
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Estimator:
    name: str
    advantages: AdvantageFn
    policy_loss: PolicyLossFn
    group_normalized: bool = False  # rewards are centred on their prompt group's mean before `advantages`
    divide_by_std: bool = False  # ... and divided by the group's std (unless --disable-grpo-std-normalization)
    needs_critic: bool = False  # a value model (the PPO critic) trains next to the policy
    whitens: bool = False  # the advantages are meant to be whitened: --normalize-advantages is required


# ---- advantages ----------------------------------------------------------------------------------------
def _kl_per_row(args, inputs: AdvantageInputs) -> list[torch.Tensor | None]:
    """The KL term of the token rewards: only with --kl-coef and a reference model."""
    kl_coef = float(args.kl_coef)
    return inputs.kl if inputs.kl is not None and kl_coef else [None] * len(inputs.rewards)


def scalar_reward_advantages(args, inputs: AdvantageInputs) -> tuple[Tensors, None]:
    """GRPO-like: each row's (normalised) reward broadcast to its response tokens; no returns."""
    return ppo_utils.get_grpo_advantages(inputs.rewards, inputs.response_lengths), None


def reinforce_plus_plus_advantages(args, inputs: AdvantageInputs) -> tuple[Tensors, Tensors]:
    """REINFORCE++: discounted returns of the KL-shaped token rewards; advantages = returns."""
    token_rewards = [ppo_utils.kl_shaped_token_rewards(r, k, float(args.kl_coef), m)
                     for r, k, m in zip(inputs.rewards, _kl_per_row(args, inputs), inputs.loss_masks)]
    returns = [ppo_utils.discounted_returns(tr, float(args.gamma)) for tr in token_rewards]
    return returns, returns


def reinforce_plus_plus_baseline_advantages(args, inputs: AdvantageInputs) -> tuple[Tensors, Tensors]:
    """REINFORCE++-baseline: the (group-mean-centred) reward − kl_coef·KL on every token."""
    kl_coef = float(args.kl_coef)
    advantages = []
    for r, k, m in zip(inputs.rewards, _kl_per_row(args, inputs), inputs.loss_masks):
        a = torch.full((m.shape[0],), float(r), dtype=torch.float32)
        advantages.append(a if k is None else a - kl_coef * k.float() * m.float())
    return advantages, advantages


def gae_advantages(args, inputs: AdvantageInputs) -> tuple[Tensors, Tensors]:
    """PPO: GAE over the KL-shaped token rewards and the critic's values; returns = advantages + values."""
    if inputs.values is None:
        raise ValueError("--advantage-estimator ppo: no critic values were given to the actor's train step")
    token_rewards = [ppo_utils.kl_shaped_token_rewards(r, k, float(args.kl_coef), m)
                     for r, k, m in zip(inputs.rewards, _kl_per_row(args, inputs), inputs.loss_masks)]
    out = [ppo_utils.gae_advantages_and_returns(tr, v, float(args.gamma), float(args.lambd))
           for tr, v in zip(token_rewards, inputs.values)]
    return [a for a, _ in out], [r for _, r in out]


# ---- policy losses ---------------------------------------------------------------------------------------
def ppo_clip_loss(log_probs, old_log_probs, advantages, mask, args):
    """Token-level PPO clipped surrogate (dual clip with --eps-clip-c)."""
    return ppo_utils.compute_policy_loss(log_probs, old_log_probs, advantages, args.eps_clip, args.eps_clip_high,
                                         args.eps_clip_c)


def gspo_loss(log_probs, old_log_probs, advantages, mask, args):
    """The clipped surrogate on GSPO's sequence-level ratio."""
    return ppo_utils.compute_gspo_policy_loss(log_probs, old_log_probs, advantages, mask, args.eps_clip,
                                              args.eps_clip_high, args.eps_clip_c)


def cispo_loss(log_probs, old_log_probs, advantages, mask, args):
    """CISPO: REINFORCE with a clipped, gradient-free importance weight."""
    return ppo_utils.compute_cispo_policy_loss(log_probs, old_log_probs, advantages, args.eps_clip, args.eps_clip_high)


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("grpo", scalar_reward_advantages, ppo_clip_loss, group_normalized=True, divide_by_std=True),
    Estimator("gspo", scalar_reward_advantages, gspo_loss, group_normalized=True, divide_by_std=True),
    Estimator("cispo", scalar_reward_advantages, cispo_loss, group_normalized=True, divide_by_std=True),
    Estimator("reinforce_plus_plus", reinforce_plus_plus_advantages, ppo_clip_loss, whitens=True),
    Estimator("reinforce_plus_plus_baseline", reinforce_plus_plus_baseline_advantages, ppo_clip_loss,
              group_normalized=True, whitens=True),
    Estimator("ppo", gae_advantages, ppo_clip_loss, needs_critic=True),
)}


def estimator_of(args) -> Estimator:
    try:
        return ESTIMATORS[args.advantage_estimator]
    except KeyError:
        raise ValueError(f"--advantage-estimator {args.advantage_estimator!r}: unknown; choose one of "
                         f"{', '.join(ESTIMATORS)}") from None


def compute_advantages_and_returns(args, inputs: AdvantageInputs) -> tuple[Tensors, Tensors | None]:
    """Per-token advantages (and returns for a critic) of every row: `--custom-advantage-function-path` when
    given, else the estimator's. Whitening (`--normalize-advantages`) is applied afterwards by the trainer,
    across data-parallel ranks."""
    custom = args.custom_advantage_function_path
    if not custom:
        return estimator_of(args).advantages(args, inputs)
    advantages, returns = load_function(custom, "--custom-advantage-function-path")(args, inputs)
    if len(advantages) != len(inputs.rewards):
        raise ValueError(f"--custom-advantage-function-path {custom} returned {len(advantages)} advantage "
                         f"tensors for {len(inputs.rewards)} rows")
    return [torch.as_tensor(a, dtype=torch.float32) for a in advantages], returns
