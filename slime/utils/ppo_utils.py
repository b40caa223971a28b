"""The RL algorithm's math as pure functions on tensors and lists, at slime's import path and with slime's
signatures (plugins written for slime import them from here): KL estimators, group reward normalisation, the
returns and advantages of each estimator (GRPO, REINFORCE++, REINFORCE++-baseline, GAE), chunked scans for
discounted sums, masked whitening, the policy losses (PPO clip with dual clip, GSPO's sequence ratio, CISPO),
truncated importance sampling, the PPO value loss, loss aggregation, and fused vocab-parallel log-probs and
entropy. Which estimator uses which is slime/algorithm/estimators.py.

No Ray, no globals, no torch.distributed except the vocab-parallel all-reduces of
`calculate_log_probs_and_entropy` (slime's contract); every function has a closed-form unit test
(tests/unit/test_ppo_utils.py). Conventions:
- slime's list form: per-sample quantities are lists of 1-D response-aligned tensors (`kl`, `loss_masks`, ...);
  slime's flat form concatenates them (`ppo_kl`, `advantages` of a micro-batch);
- padded form: `[B, R]` response-aligned tensors with a 0/1 `mask` of the same shape (our loss);
- `log_probs` are the current policy's, `old_log_probs` the behaviour policy's, `ref_log_probs` the frozen
  reference model's, `values` the critic's V(prefix before the token); `ppo_kl` = old − new log-prob.

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
import torch.distributed as dist
import torch.nn.functional as F

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


# ---- log-probs and entropy from (vocab-parallel) logits --------------------------------------------------------
def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)


def _vocab_shard_start(local_vocab: int, group) -> int:
    """The first vocabulary id this rank's logits hold: rank × local vocab (0 without torch.distributed)."""
    if group is not None and hasattr(group, "rank") and hasattr(group, "size"):
        return group.rank() * local_vocab
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group=group) * local_vocab
    return 0


def _softmax_over_shards(logits: torch.Tensor, local_targets: torch.Tensor, group):
    """(target's shifted logit, Σ exp over the whole vocabulary [N, 1], softmax, row max [N, 1]) of fp32 rows
    whose vocabulary is split over `group`; `local_targets` are clamped into this shard (masked by the caller)."""
    row_max = logits.max(dim=-1, keepdim=True).values
    _all_reduce(row_max, dist.ReduceOp.MAX, group)
    shifted = logits - row_max
    target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1, keepdim=True)
    _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
    return target_logit, sum_exp, exp / sum_exp, row_max


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """log softmax(logits)[target] and the entropy of softmax(logits) for rows whose vocabulary is split over a
    tensor-parallel group, with a hand-written backward (the softmaxes are kept, not the autograd graph of the
    reductions):

        d log_prob / d logits = onehot(target) − p_lp        d entropy / d logits = p · (Σ p·x − x)

    `keep_mask` (engine-side top-p replay) restricts the log-prob's distribution to the kept ids (the target is
    always kept); the entropy is always the full distribution's."""

    @staticmethod
    def forward(ctx, logits, targets, keep_mask, group, with_entropy: bool, with_entropy_grad: bool):
        x = logits.float()
        local_vocab = x.shape[-1]
        start = _vocab_shard_start(local_vocab, group)
        local_targets = targets - start
        off_shard = (local_targets < 0) | (local_targets >= local_vocab)
        local_targets = local_targets.masked_fill(off_shard, 0)
        rows = torch.arange(x.shape[0], device=x.device)

        lp_logits = x
        if keep_mask is not None:
            lp_logits = x.masked_fill(~keep_mask, float("-inf"))
            on = rows[~off_shard]
            lp_logits[on, local_targets[on]] = x[on, local_targets[on]]
        target_logit, sum_exp, p_log_prob, row_max = _softmax_over_shards(lp_logits, local_targets, group)
        target_logit = target_logit.masked_fill(off_shard, 0.0).unsqueeze(-1)
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        log_prob = target_logit - sum_exp.log()

        entropy = p_entropy = sum_p_x = x.new_zeros(0)
        if with_entropy:
            if keep_mask is None:  # the log-prob's distribution is the full one
                sum_exp_e, p_entropy, max_e = sum_exp, p_log_prob, row_max
            else:
                _, sum_exp_e, p_entropy, max_e = _softmax_over_shards(x, local_targets, group)
            sum_p_x = (p_entropy * x).sum(dim=-1, keepdim=True)
            _all_reduce(sum_p_x, dist.ReduceOp.SUM, group)
            entropy = (max_e + sum_exp_e.log() - sum_p_x).squeeze(-1)

        ctx.with_entropy_grad = with_entropy and with_entropy_grad
        if not ctx.with_entropy_grad:
            ctx.mark_non_differentiable(entropy)
            p_entropy = sum_p_x = x = x.new_zeros(0)
        ctx.save_for_backward(p_log_prob, off_shard, local_targets, p_entropy, sum_p_x, x)
        # An output outside the loss gets None (not zeros): its gradient term is skipped, not multiplied by 0.
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        p_log_prob, off_shard, local_targets, p_entropy, sum_p_x, x = ctx.saved_tensors
        if grad_log_prob is None:
            grad = torch.zeros_like(p_log_prob)
        else:
            grad = -p_log_prob
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, local_targets] += (~off_shard).to(grad.dtype)
            grad = grad * grad_log_prob.reshape(-1, 1)
        if ctx.with_entropy_grad and grad_entropy is not None and grad_entropy.numel():
            grad = grad + p_entropy * (sum_p_x - x) * grad_entropy.reshape(-1, 1)
        return grad, None, None, None, None, None


def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask: torch.Tensor | None = None,
    with_entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[N, 1]` of `tokens` [N] under softmax(logits) and, with `with_entropy`, the entropy `[N]`, from
    fp32-cast `logits` [N, V/tp] whose vocabulary is split over `tp_group` (slime's contract: None is the
    default group when torch.distributed is initialized, a single shard otherwise). `chunk_size` > 0 works
    through the rows in chunks of that many (less memory). `log_prob_keep_mask` [N, V/tp] restricts the
    log-prob's distribution to the kept ids (the sampled token always stays). `with_entropy_grad=False`
    returns the entropy as a metric only. Empty input gives `[0]` tensors."""
    if logits.shape[0] == 0:
        return logits.new_zeros(0), (logits.new_zeros(0) if with_entropy else None)
    logits = logits.contiguous()
    step = chunk_size if chunk_size > 0 else logits.shape[0]
    keep = log_prob_keep_mask.split(step) if log_prob_keep_mask is not None else [None] * (-(-len(tokens) // step))
    log_probs, entropies = [], []
    for lg, tk, km in zip(logits.split(step), tokens.split(step), keep):
        lp, ent = _VocabParallelLogProbEntropy.apply(lg, tk, km, tp_group, with_entropy, with_entropy_grad)
        log_probs.append(lp)
        entropies.append(ent)
    log_prob = log_probs[0] if len(log_probs) == 1 else torch.cat(log_probs)
    if not with_entropy:
        return log_prob, None
    return log_prob, entropies[0] if len(entropies) == 1 else torch.cat(entropies)


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
    """A micro-batch's sum, as slime's `sum_of_sample_mean` reducer: Σ_rows (row's masked token mean), or with
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
