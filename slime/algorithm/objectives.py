"""The training objectives as pure functions on tensors: KL estimators, the policy losses (PPO clip with dual clip,
GSPO's sequence ratio, CISPO), off-policy sequence masking, truncated importance sampling weights (TIS, IcePop),
the PPO value loss and loss aggregation. Which estimator uses which is slime/algorithm/estimators.py, the loss of
a micro-batch slime/algorithm/loss.py; the names and argument orders are slime's (`slime.utils.ppo_utils`
re-exports them for plugins).

No Ray, no globals, no torch.distributed; closed-form tests in tests/unit/test_ppo_utils.py. Conventions:
- slime's flat form: per-token tensors of a micro-batch back to back (`ppo_kl`, `advantages`);
- padded form: `[B, R]` response-aligned tensors with a 0/1 `mask` of the same shape (our loss);
- `log_probs` are the current policy's, `old_log_probs` the behaviour policy's, `ref_log_probs` the frozen
  reference model's, `values` the critic's V(prefix before the token); `ppo_kl` = old − new log-prob.
"""

from __future__ import annotations

import torch

KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")


# ---- KL ------------------------------------------------------------------------------------------------
def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate (fp32) with Δ = logp − logp_base: k1 = Δ, k2 = Δ²/2, k3 = low_var_kl = e^(−Δ) − 1 + Δ.

    `importance_ratio` (`--use-unbiased-kl`: π/π_old, with its gradient) multiplies the estimate, which makes it
    unbiased for the current policy although tokens were sampled from the old one. low_var_kl is clamped to
    [−10, 10] after that (the estimate explodes when the policies drift far apart)."""
    delta = log_probs.float() - log_probs_base.float()
    if kl_loss_type == "k1":
        kl = delta
    elif kl_loss_type == "k2":
        kl = delta.square() / 2
    elif kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.exp(-delta) - 1 + delta
    else:
        raise ValueError(f"--kl-loss-type {kl_loss_type!r}: choose one of {', '.join(KL_LOSS_TYPES)}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(-10.0, 10.0) if kl_loss_type == "low_var_kl" else kl


# ---- policy losses ------------------------------------------------------------------------------------------
def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token from ppo_kl = logp_old − logp (token- or sequence-level), r = e^(−ppo_kl).

    loss = max(−r·A, −clip(r, 1−ε, 1+ε_high)·A); with dual clip c > 1, tokens with A < 0 are further
    bounded by −c·A. Returns (pg_losses, clipfrac: the clipped term was the larger one)."""
    ratio = torch.exp(-ppo_kl)
    loss_unclipped = -ratio * advantages
    loss_clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = (loss_clipped > loss_unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c {eps_clip_c}: the dual-clip bound must be > 1 (e.g. 3.0)")
        dual = torch.minimum(pg_losses, -eps_clip_c * advantages)
        pg_losses = torch.where(advantages < 0, dual, pg_losses)
    return pg_losses, clipfrac


def compute_cispo_loss(
    ppo_kl: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): loss = −sg(clip(r, 1−ε, 1+ε_high))·A·logp with r = e^(−ppo_kl). The clipped ratio
    carries no gradient, so every token keeps a REINFORCE gradient through `log_probs` (none is dropped by
    clipping). Returns (pg_losses, clipfrac: the ratio was clipped)."""
    ratio = torch.exp(-ppo_kl)
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return -weight.detach() * advantages * log_probs, (weight != ratio).float()


def sequence_ppo_kl(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ppo_kl on padded rows: each row's masked mean of (logp_old − logp), broadcast back to the row's
    tokens ([B, R]). Gradients reach every token of the row through the mean: the ratio is sequence-level."""
    return per_sample_masked_mean(old_log_probs - log_probs, mask).unsqueeze(-1).expand_as(log_probs)


def opsm_mask(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              delta: float) -> torch.Tensor:
    """Off-policy sequence masking (`--use-opsm`), slime's rule on padded rows [B, R]: a token is dropped (0) when
    its advantage is negative and its row's masked mean of (logp_old − logp) is strictly above `delta`; every other
    token keeps weight 1. So a sequence the current policy has drifted away from (it is now less likely than under
    the behaviour policy) stops being pushed down further. Returns the {0, 1} keep-mask [B, R], without gradient."""
    seq_kl = per_sample_masked_mean((old_log_probs - log_probs).detach(), mask).unsqueeze(-1)
    dropped = (advantages < 0) & (seq_kl > delta)
    return 1.0 - dropped.to(log_probs.dtype)


def tis_weights(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, tis_clip: float,
                tis_clip_low: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling (`--use-tis`), element-wise on any shape: the ratio
    ρ = exp(logp_train − logp_rollout) clamped to [tis_clip_low, tis_clip]. Returns (weights, slime's metrics
    per token: "tis" = ρ, "tis_clipfrac" = ρ was clamped, "tis_abs" = |ρ − 1|)."""
    ratio = torch.exp(train_log_probs - rollout_log_probs)
    weights = ratio.clamp(tis_clip_low, tis_clip)
    return weights, _ratio_metrics(ratio, weights)


def icepop_weights(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, tis_clip: float,
                   tis_clip_low: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IcePop: like `tis_weights`, but a ratio outside [tis_clip_low, tis_clip] zeroes the token's weight
    instead of being clamped ("tis_clipfrac" then counts the zeroed tokens)."""
    ratio = torch.exp(train_log_probs - rollout_log_probs)
    inside = (ratio >= tis_clip_low) & (ratio <= tis_clip)
    weights = torch.where(inside, ratio, torch.zeros_like(ratio))
    return weights, _ratio_metrics(ratio, weights)


def _ratio_metrics(ratio: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"tis": ratio.detach(), "tis_clipfrac": (weights != ratio).float().detach(),
            "tis_abs": (ratio - 1).abs().detach()}


# ---- value loss ------------------------------------------------------------------------------------------
def compute_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO critic loss per token, slime's: max((V_clip − R)², (V − R)²) with
    V_clip = V_old + clip(V − V_old, −value_clip, value_clip); without `value_clip`, (V − R)².
    Returns (per-token losses, clipfrac = |V − V_old| > value_clip)."""
    unclipped = (values - returns).square()
    if value_clip is None:
        return unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns).square()
    return torch.maximum(unclipped, clipped), ((values - old_values).abs() > value_clip).float()


# ---- aggregation -------------------------------------------------------------------------------------------
def per_sample_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] -> [B]: each row's mean over its masked entries (0 for a row with an all-zero mask)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)


def sum_of_sample_mean(values: torch.Tensor, mask: torch.Tensor, per_token: bool) -> torch.Tensor:
    """A micro-batch's sum: Σ_rows (row's masked token mean), or with
    `per_token` (`--calculate-per-token-loss`) Σ of the masked tokens. [B, R] -> scalar."""
    if per_token:
        return (values * mask.to(values.dtype)).sum()
    return per_sample_masked_mean(values, mask).sum()


def aggregate_loss(
    values: torch.Tensor, mask: torch.Tensor, per_token: bool, global_denominator: float
) -> torch.Tensor:
    """A micro-batch's share of the global-batch loss: `sum_of_sample_mean` / global_denominator.

    Default: global_denominator = number of samples in the global batch, so summing the shares over
    micro-batches and data-parallel ranks gives the mean over samples of each sample's token mean. `per_token`
    (`--calculate-per-token-loss`): global_denominator = masked tokens in the global batch, i.e. a global
    token mean."""
    if global_denominator <= 0:
        raise ValueError(f"aggregate_loss: global_denominator must be > 0, got {global_denominator}")
    return sum_of_sample_mean(values, mask, per_token) / global_denominator
