"""The RL algorithm as pure functions on tensors and lists: KL estimators, group reward normalisation,
advantages, the clipped policy loss (token- and sequence-level) and loss aggregation.

No Ray, no torch.distributed, no globals: every function here has a closed-form unit test
(tests/unit/test_ppo_utils.py). Conventions:
- per-token tensors of a micro-batch are padded `[B, R]` response-aligned tensors (R = longest response),
  with a 0/1 `mask` of the same shape (response positions whose loss counts);
- `log_probs` are the current policy's, `old_log_probs` the behaviour policy's, `ref_log_probs` the
  frozen reference model's, all fp32.

Implemented advantage estimators: grpo and gspo (the scalar, already group-normalised reward broadcast to
each response token). ppo, reinforce_plus_plus(_baseline) and cispo are accepted by the argument parser
but raise `NotImplementedError` here, naming `--advantage-estimator`; they slot into `compute_advantages`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
# Estimators whose advantage is the (group-normalised) scalar reward broadcast to every response token.
SCALAR_REWARD_ESTIMATORS = ("grpo", "gspo")
NOT_YET_IMPLEMENTED_ESTIMATORS = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "cispo")


# ---- KL ------------------------------------------------------------------------------------------------
def compute_approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_loss_type: str) -> torch.Tensor:
    """Per-token KL estimate with Δ = logp − logp_ref: k1 = Δ, k2 = Δ²/2, k3 = low_var_kl = e^(−Δ) − 1 + Δ.

    low_var_kl is clamped to [−10, 10] (the estimate explodes when the policies drift far apart)."""
    delta = log_probs - ref_log_probs
    if kl_loss_type == "k1":
        return delta
    if kl_loss_type == "k2":
        return delta.square() / 2
    if kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.exp(-delta) - 1 + delta
        return kl.clamp(-10.0, 10.0) if kl_loss_type == "low_var_kl" else kl
    raise ValueError(f"--kl-loss-type {kl_loss_type!r}: choose one of {', '.join(KL_LOSS_TYPES)}")


# ---- rewards and advantages ----------------------------------------------------------------------------
def group_normalize_rewards(
    rewards: list[float], group_indices: list[int], std_normalize: bool, eps: float = 1e-6
) -> list[float]:
    """Subtract each group's mean reward; with `std_normalize`, divide by (unbiased group std + eps).

    Groups are formed by `group_indices` (not by position), so fan-out, filtering or reordering cannot
    mix prompts. A one-member group is only mean-centred (its std is undefined)."""
    if len(rewards) != len(group_indices):
        raise ValueError(f"group_normalize_rewards: {len(rewards)} rewards but {len(group_indices)} group indices")
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_indices):
        members[g].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        values = [float(rewards[i]) for i in idx]
        mean = sum(values) / len(values)
        std = None
        if std_normalize and len(values) > 1:
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for i, v in zip(idx, values):
            out[i] = (v - mean) / (std + eps) if std is not None else v - mean
    return out


def get_grpo_advantages(rewards: Sequence[float], response_lengths: Sequence[int]) -> list[torch.Tensor]:
    """Each sample's (already normalised) scalar reward, repeated for each of its response tokens."""
    if len(rewards) != len(response_lengths):
        raise ValueError(f"get_grpo_advantages: {len(rewards)} rewards but {len(response_lengths)} response lengths")
    return [torch.full((int(n),), float(r), dtype=torch.float32) for r, n in zip(rewards, response_lengths)]


def compute_advantages(
    advantage_estimator: str, rewards: Sequence[float], response_lengths: Sequence[int]
) -> list[torch.Tensor]:
    """Per-token advantages of every sample, dispatched on `--advantage-estimator`."""
    if advantage_estimator in SCALAR_REWARD_ESTIMATORS:
        return get_grpo_advantages(rewards, response_lengths)
    if advantage_estimator in NOT_YET_IMPLEMENTED_ESTIMATORS:
        raise NotImplementedError(
            f"--advantage-estimator {advantage_estimator}: not implemented in this backend yet; "
            f"use one of {', '.join(SCALAR_REWARD_ESTIMATORS)}"
        )
    raise ValueError(
        f"--advantage-estimator {advantage_estimator!r}: unknown; choose one of "
        f"{', '.join(SCALAR_REWARD_ESTIMATORS + NOT_YET_IMPLEMENTED_ESTIMATORS)}"
    )


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values − mean) / std over the masked entries (`--normalize-advantages`); unmasked entries are kept."""
    mask = mask.to(values.dtype)
    n = mask.sum().clamp_min(1.0)
    mean = (values * mask).sum() / n
    var = ((values - mean).square() * mask).sum() / n
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, values)


# ---- policy loss -----------------------------------------------------------------------------------------
def policy_loss_from_log_ratio(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate from log r = logp − logp_old (token- or sequence-level).

    loss = max(−r·A, −clip(r, 1−ε, 1+ε_high)·A); with dual clip c > 1, tokens with A < 0 are further
    bounded by −c·A. Returns per-token (pg_losses, clipfrac, ppo_kl) with ppo_kl = −log r."""
    ratio = torch.exp(log_ratio)
    loss_unclipped = -ratio * advantages
    loss_clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = (loss_clipped > loss_unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c {eps_clip_c}: the dual-clip bound must be > 1 (e.g. 3.0)")
        dual = torch.minimum(pg_losses, -eps_clip_c * advantages)
        pg_losses = torch.where(advantages < 0, dual, pg_losses)
    return pg_losses, clipfrac, -log_ratio


def compute_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-level PPO/GRPO policy loss; see `policy_loss_from_log_ratio`."""
    return policy_loss_from_log_ratio(log_probs - old_log_probs, advantages, eps_clip, eps_clip_high, eps_clip_c)


def sequence_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: each row's masked mean of (logp − logp_old), broadcast back to the row's tokens ([B, R]).

    Gradients flow to every token of the row through the mean, which is what makes the ratio
    sequence-level."""
    per_sample = per_sample_masked_mean(log_probs - old_log_probs, mask)
    return per_sample.unsqueeze(-1).expand_as(log_probs)


def compute_gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO policy loss: the clipped surrogate on the sequence-level ratio exp(mean token log-ratio)."""
    log_ratio = sequence_log_ratio(log_probs, old_log_probs, mask)
    return policy_loss_from_log_ratio(log_ratio, advantages, eps_clip, eps_clip_high, eps_clip_c)


def compute_tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, tis_clip: float, tis_clip_low: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling (`--use-tis`): clamp(exp(logp_old − logp_rollout), low, high).

    Returns (weights, per-token clipped indicator)."""
    raw = torch.exp(old_log_probs - rollout_log_probs)
    weights = raw.clamp(tis_clip_low, tis_clip)
    return weights, (weights != raw).float()


def compute_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension, in fp32."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


# ---- aggregation -------------------------------------------------------------------------------------------
def per_sample_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] -> [B]: each row's mean over its masked entries (0 for a row with an all-zero mask)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)


def aggregate_loss(
    values: torch.Tensor, mask: torch.Tensor, per_token: bool, global_denominator: float
) -> torch.Tensor:
    """A micro-batch's share of the global-batch loss.

    Default: Σ_rows (row's masked token mean) / global_denominator, with global_denominator = number of
    samples in the global batch, so summing the shares over micro-batches and data-parallel ranks gives
    the mean over samples of each sample's token mean. `per_token` (`--calculate-per-token-loss`):
    Σ masked tokens / global_denominator with global_denominator = masked tokens in the global batch,
    i.e. a global token mean."""
    if global_denominator <= 0:
        raise ValueError(f"aggregate_loss: global_denominator must be > 0, got {global_denominator}")
    if per_token:
        return (values * mask.to(values.dtype)).sum() / global_denominator
    return per_sample_masked_mean(values, mask).sum() / global_denominator
