"""The RL algorithm's math as pure functions on tensors and lists: KL estimators, group reward normalisation,
the advantages and returns the estimators are built from, masked whitening, the policy losses (PPO clip,
GSPO, CISPO), TIS, the PPO value loss and loss aggregation. Which estimator uses which is
slime/algorithm/estimators.py.

No Ray, no torch.distributed, no globals: every function here has a closed-form unit test
(tests/unit/test_ppo_utils.py). Conventions:
- per-sample quantities are lists of 1-D tensors (one entry per response token); per-token tensors of a
  micro-batch are padded `[B, R]` response-aligned tensors with a 0/1 `mask` of the same shape;
- `log_probs` are the current policy's, `old_log_probs` the behaviour policy's, `ref_log_probs` the
  frozen reference model's, `values` the critic's V(prefix before the token), all fp32.

Simplifications: GAE and discounted returns step over every response token, loss-masked (tool) tokens
included, with the KL of a loss-masked token taken as 0; the scalar reward sits on the last response token.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch


KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")


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


def unbiased_kl(kl: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    """`--use-unbiased-kl`: weight each token's KL estimate by the (gradient-free) importance ratio
    π/π_old, which makes the estimate unbiased for the current policy although tokens were sampled from
    the old one."""
    return kl * torch.exp(log_probs - old_log_probs).detach()


# ---- rewards -------------------------------------------------------------------------------------------
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


def kl_shaped_token_rewards(
    reward: float, kl: torch.Tensor | None, kl_coef: float, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """PPO / REINFORCE++ per-token reward: −kl_coef·KL_t on every token (0 on loss-masked tokens), plus
    the sample's scalar reward on the last response token. `kl` is [T] (None: no KL term)."""
    if kl is None:
        if loss_mask is None:
            raise ValueError("kl_shaped_token_rewards: give kl or loss_mask (to know the response length)")
        token_rewards = torch.zeros(loss_mask.shape[0], dtype=torch.float32)
    else:
        token_rewards = -kl_coef * kl.float()
        if loss_mask is not None:
            token_rewards = token_rewards * loss_mask.float()
    token_rewards = token_rewards.clone()
    if token_rewards.numel():
        token_rewards[-1] += float(reward)
    return token_rewards


# ---- advantages and returns ----------------------------------------------------------------------------
def get_grpo_advantages(rewards: Sequence[float], response_lengths: Sequence[int]) -> list[torch.Tensor]:
    """Each sample's (already normalised) scalar reward, repeated for each of its response tokens."""
    if len(rewards) != len(response_lengths):
        raise ValueError(f"get_grpo_advantages: {len(rewards)} rewards but {len(response_lengths)} response lengths")
    return [torch.full((int(n),), float(r), dtype=torch.float32) for r, n in zip(rewards, response_lengths)]


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ·G_{t+1}, G_T = 0 (REINFORCE++)."""
    returns = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = 0.0
    for t in range(token_rewards.shape[0] - 1, -1, -1):
        running = float(token_rewards[t]) + gamma * running
        returns[t] = running
    return returns


def gae_advantages_and_returns(
    token_rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one response (PPO).

    δ_t = r_t + γ·V_{t+1} − V_t with V_T = 0 (the episode ends after the last token);
    A_t = δ_t + γλ·A_{t+1}; returns R_t = A_t + V_t (the critic's regression target)."""
    if token_rewards.shape != values.shape:
        raise ValueError(f"gae: token_rewards {tuple(token_rewards.shape)} vs values {tuple(values.shape)}")
    values = values.float()
    advantages = torch.zeros_like(values)
    running = 0.0
    for t in range(values.shape[0] - 1, -1, -1):
        next_value = float(values[t + 1]) if t + 1 < values.shape[0] else 0.0
        delta = float(token_rewards[t]) + gamma * next_value - float(values[t])
        running = delta + gamma * lambd * running
        advantages[t] = running
    return advantages, advantages + values


# ---- whitening -------------------------------------------------------------------------------------------
def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[Σ m·x, Σ m·x², Σ m] in float64: additive over shards, so all-reducing it (a SUM over
    data-parallel ranks) gives the moments of the whole batch."""
    m = mask.double()
    x = values.double()
    return torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()])


def whiten_with_moments(values: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor,
                        eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) with the (population) mean and variance of `moments`; entries with
    mask 0 are returned unchanged."""
    total, total_sq, count = (float(v) for v in moments)
    count = max(count, 1.0)
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    whitened = (values - mean) / math.sqrt(var + eps)
    return torch.where(mask.bool(), whitened.to(values.dtype), values)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`--normalize-advantages` on one shard: whiten over its masked entries."""
    return whiten_with_moments(values, mask, masked_moments(values, mask), eps)


# ---- policy losses ------------------------------------------------------------------------------------------
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


def compute_cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: loss = −sg(clip(r, 1−ε, 1+ε_high))·A·logp. The clipped importance weight carries no
    gradient, so every token keeps a REINFORCE gradient (no token is dropped by clipping).
    Returns per-token (pg_losses, clipfrac = weight was clipped, ppo_kl = −log r)."""
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return -weight * advantages * log_probs, (weight != ratio).float(), -log_ratio


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


# ---- value loss ------------------------------------------------------------------------------------------
def compute_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO critic loss per token: ½·max((V_clip − R)², (V − R)²) with
    V_clip = V_old + clip(V − V_old, −value_clip, value_clip); without `value_clip`, ½·(V − R)².
    Returns (per-token losses, clipfrac = the clipped term was the larger one)."""
    unclipped = (values - returns).square()
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


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
