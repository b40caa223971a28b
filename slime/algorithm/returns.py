"""Returns and advantages as pure functions on tensors and lists: group reward normalisation, chunked scans for
discounted sums and GAE, the returns / advantages of each estimator (GRPO, REINFORCE++, REINFORCE++-baseline,
PPO's KL-penalised token rewards and GAE) and masked whitening. Which estimator uses which is
slime/algorithm/estimators.py; the names and argument orders are slime's (`slime.utils.ppo_utils` re-exports
them for plugins).

No Ray, no globals, no torch.distributed; closed-form tests in tests/unit/test_ppo_utils.py. Conventions:
- slime's list form: per-sample quantities are lists of 1-D response-aligned tensors (`kl`, `loss_masks`, ...);
- padded form: `[B, T]` right-padded rows.

Simplifications against slime: rows are whole responses here (no context-parallel slicing), so the
`response_lengths` / `total_lengths` slime's REINFORCE++ and GAE helpers take are accepted for their signature
and the tensors' own lengths are used; a sample whose loss mask is all 0 (dropped from the loss) gets no
REINFORCE++ reward instead of slime's assertion.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F


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


# ---- discounted sums -----------------------------------------------------------------------------------
def chunked_discounted_returns(rewards: torch.Tensor, discount: float, chunk_size: int = 128) -> torch.Tensor:
    """G_t = r_t + discount·G_{t+1} (G_T = 0) for every row of `rewards` [B, T], in the input's dtype.

    In reversed time the recurrence runs forward, S_i = x_i + discount·S_{i−1}. The reversed axis is cut into
    chunks of `chunk_size`: inside a chunk, S is one matmul with the upper-triangular matrix of discount powers
    (parallel; each sum adds its farthest, most discounted terms first, which keeps fp32 error low), and only
    the hand-over between chunks is a loop (T / chunk_size steps instead of T). Right padding with zeros stays
    zero."""
    if rewards.ndim != 2:
        raise ValueError(f"chunked_discounted_returns: rewards must be [B, T], got shape {tuple(rewards.shape)}")
    batch, length = rewards.shape
    if length == 0:
        return rewards.clone()
    n_chunks = -(-length // chunk_size)
    reversed_rewards = F.pad(rewards.flip(1), (0, n_chunks * chunk_size - length))
    steps = torch.arange(chunk_size, device=rewards.device)
    gap = (steps.unsqueeze(0) - steps.unsqueeze(1)).to(rewards.dtype)  # gap[i, j] = j - i
    # powers[i, j] = discount^(j - i) for j >= i: S_j inside the chunk = sum_i x_i * powers[i, j]
    powers = torch.where(gap >= 0, discount ** gap.clamp_min(0), torch.zeros_like(gap))
    # the previous chunk's last S reaches step j discounted by discount^(j + 1)
    carry_weight = discount ** (steps + 1).to(rewards.dtype)
    local = (reversed_rewards.view(batch * n_chunks, chunk_size) @ powers).view(batch, n_chunks, chunk_size)
    out = torch.empty_like(local)
    carry = torch.zeros(batch, 1, dtype=rewards.dtype, device=rewards.device)
    for c in range(n_chunks):
        out[:, c] = local[:, c] + carry * carry_weight
        carry = out[:, c, -1:]
    return out.view(batch, n_chunks * chunk_size)[:, :length].flip(1)


def _gae_deltas(rewards: torch.Tensor, values: torch.Tensor, gamma: float) -> torch.Tensor:
    """δ_t = r_t + γ·V_{t+1} − V_t with V_T = 0 (the episode ends after the last token)."""
    if rewards.ndim != 2 or rewards.shape != values.shape:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must both be [B, T]")
    next_values = F.pad(values[:, 1:], (0, 1))
    return rewards + gamma * next_values - values


def vanilla_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over rows [B, T], one time step at a time (the reference for
    `chunked_gae`): A_t = δ_t + γλ·A_{t+1}; returns R_t = A_t + V_t (the critic's target)."""
    deltas = _gae_deltas(rewards, values, gamma)
    advantages = torch.zeros_like(deltas)
    running = torch.zeros_like(deltas[:, 0])
    for t in range(deltas.shape[1] - 1, -1, -1):
        running = deltas[:, t] + gamma * lambd * running
        advantages[:, t] = running
    return advantages, advantages + values


def chunked_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float, chunk_size: int = 128
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`vanilla_gae` as a chunked scan: the advantages are the deltas' discounted sums with discount γλ."""
    advantages = chunked_discounted_returns(_gae_deltas(rewards, values, gamma), gamma * lambd, chunk_size)
    return advantages, advantages + values


def _pad_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """[len(rows), max length] right-padded with zeros, in the rows' dtype and device."""
    width = max(r.shape[0] for r in rows)
    out = rows[0].new_zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


# ---- advantages and returns (slime's per-estimator helpers) ----------------------------------------------
def get_grpo_returns(rewards: torch.Tensor | Sequence[float], kl: list[torch.Tensor]) -> list[torch.Tensor]:
    """GRPO / GSPO / CISPO: each sample's (already group-normalised) reward on every token; `kl` gives the shapes."""
    return [torch.ones_like(k) * float(r) for r, k in zip(rewards, kl)]


def get_reinforce_plus_plus_returns(
    rewards: torch.Tensor | Sequence[float],
    kl: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    response_lengths: list[int],
    total_lengths: list[int],
    kl_coef: float,
    gamma: float,
) -> list[torch.Tensor]:
    """REINFORCE++: discounted returns (γ = `gamma`) of the token rewards −kl_coef·KL_t·mask_t, with the sample's
    scalar reward added on its last loss-masked-in token (a trailing tool / observation token cannot carry it).
    The lengths are slime's signature (context-parallel slicing, not done here: rows are whole responses)."""
    if not kl:
        return []
    token_rewards = []
    for reward, k, mask in zip(rewards, kl, loss_masks):
        row = -kl_coef * (k * mask)
        kept = mask.nonzero(as_tuple=True)[0]
        if kept.numel():
            row[kept[-1]] += float(reward)
        token_rewards.append(row)
    returns = chunked_discounted_returns(_pad_rows(token_rewards), gamma)
    return [returns[i, : row.shape[0]] for i, row in enumerate(token_rewards)]


def get_reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor | Sequence[float], kl: list[torch.Tensor], loss_masks: list[torch.Tensor], kl_coef: float
) -> list[torch.Tensor]:
    """REINFORCE++-baseline (before whitening): the group-mean-centred reward − kl_coef·KL_t on every token
    (`loss_masks` is slime's signature: loss-masked tokens count neither in the loss nor in the whitening)."""
    return [torch.ones_like(k) * float(r) - kl_coef * k for r, k in zip(rewards, kl)]


def kl_penalized_token_rewards(rewards: Sequence[float], kl: list[torch.Tensor], kl_coef: float
                               ) -> list[torch.Tensor]:
    """PPO's token rewards: −kl_coef·KL_t on every response token, plus the scalar reward on the last one."""
    out = []
    for reward, k in zip(rewards, kl):
        row = -kl_coef * k
        if row.numel():
            row[-1] += float(reward)
        out.append(row)
    return out


def get_advantages_and_returns_batch(
    total_lengths: list[int],
    response_lengths: list[int],
    values_list: list[torch.Tensor],
    rewards_list: list[torch.Tensor],
    gamma: float,
    lambd: float,
    chunked: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO: GAE of every sample (token rewards and critic values, one [T_i] tensor each), padded into one batch
    for `chunked_gae` (or `vanilla_gae`); returns per-sample (advantages, returns). No gradient. The lengths
    are slime's signature (context-parallel slicing, not done here)."""
    if len(values_list) != len(rewards_list):
        raise ValueError(f"gae: {len(values_list)} value rows but {len(rewards_list)} reward rows")
    if not values_list:
        return [], []
    for i, (v, r) in enumerate(zip(values_list, rewards_list)):
        if v.shape != r.shape:
            raise ValueError(f"gae: sample {i} has values of shape {tuple(v.shape)} but rewards {tuple(r.shape)}")
    with torch.no_grad():
        values = _pad_rows([v.to(rewards_list[0].dtype) for v in values_list])
        gae = chunked_gae if chunked else vanilla_gae
        advantages, returns = gae(_pad_rows(rewards_list), values, gamma, lambd)
    lengths = [r.shape[0] for r in rewards_list]
    return [advantages[i, :n] for i, n in enumerate(lengths)], [returns[i, :n] for i, n in enumerate(lengths)]


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
