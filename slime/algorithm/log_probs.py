"""Log-probs of target tokens, and optionally the entropy, from logits whose vocabulary may be split over a
process group: the one autograd kernel of both trainers (`log_probs_and_entropy`). slime's
`calculate_log_probs_and_entropy` (its `ppo_utils` API, for plugins) keeps its own small Function at the end of
this file: slime's tests compare it with an unfused reference in slime's reduction order at 1e-8, which the
chunked kernel meets only to rounding.

Each rank of `group` holds a contiguous slice of the vocabulary, slices in group-rank order (Megatron's
vocab-parallel layout; `group=None` is one rank holding all of it, the fsdp backend). Columns at or past
`vocab_size` are padding (Megatron pads the vocabulary to a multiple of 128 × TP) and left out, so the
distribution is the one the engine samples from. The plain autograd form (`.float()`, divide by the
temperature, log-softmax, ...) keeps several fp32 tensors of the logits' size alive until backward, 12 to 20 B per
logit; this one saves the logits as they are (the model's dtype), the rows it reads and a few floats per row, and
goes through the rows in chunks of about `CHUNK_ELEMENTS` logits, recomputing the softmax in backward.
Per row, with x = logits / t over this rank's real columns:

    pass 1: m = max x (all-reduced, MAX)
    pass 2: s = Σ exp(x - m), x_target (on the rank that owns it), Σ exp(x - m)·x (all-reduced together, SUM)
            lse = m + log s, log_prob = x_target - lse, E[x] = Σ exp(x - m)·x / s, entropy = lse - E[x]
    backward: p = exp(x - lse);  d/dx = g_lp · (onehot(target) - p) - g_ent · p · (x - E[x]);  d/dlogits = d/dx / t

With a `keep_mask` (slime's top-p replay) the log-prob's distribution is restricted to the kept columns (the
target always stays): a second max and sum over them give its own lse, and p in the log-prob's gradient is that
restricted softmax; the entropy stays the full distribution's. Each rank's gradient is its own slice's (the
outputs are the same on every rank, so nothing is reduced in backward); rows not read, and padding columns, get
zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 26  # fp32 elements per chunk (256 MB)
KERNELS = ("torch", "triton")  # --log-probs-kernel


def log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    rows: torch.Tensor | None = None,
    vocab_size: int | None = None,
    group=None,
    keep_mask: torch.Tensor | None = None,
    entropy_grad: bool = True,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] and, with `with_entropy`, the entropy of the same distribution,
    in fp32 (fp64 for fp64 logits); differentiable in `logits`, the gradient in the logits' dtype.

    `logits` [..., V_local] with `targets` [...] gives outputs of `targets`' shape; with `rows` [N], `logits` is
    [T, V_local], only those rows are read and `targets` [N] / the outputs are per read row. `vocab_size`: the
    real vocabulary (None: every column is real). `group`: the process group the vocabulary is split over (None:
    not split). `keep_mask` (bool, the logits' shape): the log-prob's distribution keeps only those columns and
    the target. `entropy_grad=False` returns the entropy as a metric only (no gradient). `chunk_rows`: rows per
    chunk (default: about `CHUNK_ELEMENTS` logits). `--log-probs-kernel triton` calls log_probs_triton.py's
    `log_probs_and_entropy_triton` instead (the same arguments but `keep_mask` and `chunk_rows`)."""
    v = vocab_view(logits, targets, rows, vocab_size, group, temperature, keep_mask)
    step = chunk_rows if chunk_rows else max(1, CHUNK_ELEMENTS // max(v.real, 1))
    log_probs, entropy = _LogProbs.apply(v.logits, v.rows, v.targets, v.keep_mask, float(temperature), v.real,
                                         v.start, with_entropy, entropy_grad, step, group)
    return log_probs.view(v.shape), (entropy.view(v.shape) if with_entropy else None)


@dataclass
class VocabView:
    """A call's logits as `[T, V_local]` rows, its targets `[N]` (on the logits' device), the rows read (None:
    all), the outputs' shape, the real columns of this rank's slice and the vocabulary id of its first column."""

    logits: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor | None
    keep_mask: torch.Tensor | None
    shape: torch.Size
    real: int
    start: int


def vocab_view(logits, targets, rows, vocab_size, group, temperature: float, keep_mask=None) -> VocabView:
    """`log_probs_and_entropy`'s arguments checked and laid out for either kernel."""
    if temperature <= 0:
        raise ValueError(f"temperature {temperature}: must be > 0")
    if rows is None:
        shape = targets.shape
        logits = logits.reshape(-1, logits.shape[-1])
        if keep_mask is not None:
            keep_mask = keep_mask.reshape(logits.shape)
        targets = targets.reshape(-1)
    else:
        if logits.dim() != 2:
            raise ValueError(f"logits of shape {tuple(logits.shape)} with rows: expected [rows, vocabulary slice]")
        rows = rows.to(logits.device).long()
        shape = rows.shape
    local_vocab = logits.shape[-1]
    start = dist.get_rank(group) * local_vocab if group is not None else 0
    real = local_vocab if vocab_size is None else min(local_vocab, max(0, vocab_size - start))
    return VocabView(logits, targets.to(logits.device).long(), rows, keep_mask, shape, real, start)


def mark_outputs(ctx, entropy: torch.Tensor, with_entropy: bool, entropy_grad: bool) -> None:
    """The autograd flags of a log-prob Function's outputs: the entropy a metric only without `entropy_grad`; an
    output left out of the loss gets None in backward, so its gradient term is skipped (not multiplied by 0)."""
    ctx.entropy_grad = with_entropy and entropy_grad
    if with_entropy and not entropy_grad:
        ctx.mark_non_differentiable(entropy)
    ctx.set_materialize_grads(False)


def local_targets(targets: torch.Tensor, start: int, real: int, width: int, group
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's column on this rank's slice, whether this rank owns it). A target on another rank's slice
    (or padding) reads a column of this slice, its value masked out by `owned`; with the whole vocabulary here,
    an id outside it fails in `gather`, as the plain form would."""
    local = targets - start
    owned = (local >= 0) & (local < real)
    if group is not None or real < width:
        local = local.clamp(0, max(real - 1, 0))
    return local, owned


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, targets, keep_mask, temperature: float, real_columns: int, column_start: int,
                with_entropy: bool, entropy_grad: bool, step: int, group):
        n = logits.shape[0] if rows is None else rows.numel()
        dtype = torch.promote_types(logits.dtype, torch.float32)
        dev = logits.device
        local, owned = local_targets(targets, column_start, real_columns, logits.shape[-1], group)
        masked = keep_mask is not None
        if group is None and rows is None and not masked:
            log_probs, entropy, lse, mean_x = _one_rank(logits, local, owned, temperature, real_columns, with_entropy,
                                                        step, dtype)
            ctx.save_for_backward(logits, rows, local, owned, keep_mask, lse, lse, mean_x)
            ctx.temperature, ctx.real_columns, ctx.step = temperature, real_columns, step
            mark_outputs(ctx, entropy, with_entropy, entropy_grad)
            return log_probs, entropy

        # row 0: the max of x; with a keep mask, row 1: the max over the kept columns
        row_max = torch.full((1 + masked, n), float("-inf"), dtype=dtype, device=dev)
        if real_columns:
            for c in _chunks(n, step):
                block = _read(logits, rows, c, real_columns).to(dtype)
                row_max[0, c] = block.amax(-1).div_(temperature)
                if masked:
                    kept = _kept(keep_mask, rows, c, real_columns, local, owned)
                    row_max[1, c] = block.masked_fill(~kept, float("-inf")).amax(-1).div_(temperature)
        _all_reduce(row_max, dist.ReduceOp.MAX, group)

        # Σ exp(x - m), x_target, Σ exp(x - m)·x; with a keep mask, Σ over the kept columns of exp(x - m_kept)
        sums = torch.zeros(3 + masked, n, dtype=dtype, device=dev)
        if real_columns:
            for c in _chunks(n, step):
                x = _scaled(_read(logits, rows, c, real_columns), dtype, temperature)
                sums[1, c] = x.gather(-1, local[c].unsqueeze(-1)).squeeze(-1) * owned[c]
                if masked:
                    kept = _kept(keep_mask, rows, c, real_columns, local, owned)
                    sums[3, c] = x.masked_fill(~kept, float("-inf")).sub_(row_max[1, c].unsqueeze(-1)).exp_().sum(-1)
                e = x.sub(row_max[0, c].unsqueeze(-1)).exp_()
                sums[0, c] = e.sum(-1)
                if with_entropy:
                    sums[2, c] = e.mul_(x).sum(-1)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        lse = row_max[0] + sums[0].log()
        lse_lp = row_max[1] + sums[3].log() if masked else lse
        log_probs = sums[1] - lse_lp
        mean_x = sums[2] / sums[0]
        entropy = lse - mean_x if with_entropy else torch.empty(0, dtype=dtype, device=dev)

        ctx.save_for_backward(logits, rows, local, owned, keep_mask, lse, lse_lp, mean_x)
        ctx.temperature, ctx.real_columns, ctx.step = temperature, real_columns, step
        mark_outputs(ctx, entropy, with_entropy, entropy_grad)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, rows, local, owned, keep_mask, lse, lse_lp, mean_x = ctx.saved_tensors
        t, cols = ctx.temperature, ctx.real_columns
        nothing = (None,) * 10
        with_entropy = ctx.entropy_grad and grad_entropy is not None and grad_entropy.numel()
        if not cols or (grad_log_probs is None and not with_entropy):
            return torch.zeros_like(logits), *nothing
        # every element is written below when all rows and columns are read; otherwise the rest stays zero
        whole = rows is None and cols == logits.shape[-1]
        grad = torch.empty_like(logits) if whole else torch.zeros_like(logits)
        dtype = lse.dtype
        n = logits.shape[0] if rows is None else rows.numel()
        for c in _chunks(n, ctx.step):
            x = _scaled(_read(logits, rows, c, cols), dtype, t)
            p = x.sub(lse[c].unsqueeze(-1)).exp_()
            if grad_log_probs is None:
                g = torch.zeros_like(p)
            else:
                p_lp = p
                if keep_mask is not None:
                    kept = _kept(keep_mask, rows, c, cols, local, owned)
                    p_lp = x.masked_fill(~kept, float("-inf")).sub_(lse_lp[c].unsqueeze(-1)).exp_()
                g = p_lp.mul(-grad_log_probs[c].unsqueeze(-1))
                g.scatter_add_(-1, local[c].unsqueeze(-1), (grad_log_probs[c] * owned[c]).unsqueeze(-1))
            if with_entropy:
                g.sub_(p.mul_(x.sub_(mean_x[c].unsqueeze(-1))).mul_(grad_entropy[c].unsqueeze(-1)))
            if rows is None:
                grad[c, :cols] = g.div_(t).to(grad.dtype)
            else:
                grad[rows[c], :cols] += g.div_(t).to(grad.dtype)
        return grad, *nothing


def _one_rank(logits, local, owned, temperature: float, cols: int, with_entropy: bool, step: int, dtype):
    """Every row, the whole vocabulary on this rank, no keep mask (the fsdp trainer): one pass per chunk with
    torch's logsumexp; E[x] = Σ p·x with p = exp(x - lse). The same numbers as the two-pass form to rounding; this
    form is kept because its rounding is what the CPU quick start's reproducible runs were measured with."""
    n = logits.shape[0]
    lse = torch.empty(n, dtype=dtype, device=logits.device)
    log_probs = torch.empty(n, dtype=dtype, device=logits.device)
    mean_x = torch.empty(n if with_entropy else 0, dtype=dtype, device=logits.device)
    for c in _chunks(n, step):
        x = _scaled(_read(logits, None, c, cols), dtype, temperature)
        lse[c] = torch.logsumexp(x, dim=-1)
        log_probs[c] = x.gather(-1, local[c].unsqueeze(-1)).squeeze(-1) * owned[c] - lse[c]
        if with_entropy:
            mean_x[c] = (x - lse[c].unsqueeze(-1)).exp_().mul_(x).sum(-1)
    entropy = lse - mean_x if with_entropy else torch.empty(0, dtype=dtype, device=logits.device)
    return log_probs, entropy, lse, mean_x


def _chunks(n: int, step: int) -> list[slice]:
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def _read(t: torch.Tensor, rows: torch.Tensor | None, c: slice, cols: int) -> torch.Tensor:
    """Chunk `c` of the read rows of `t`, its real columns (a view when every row is read)."""
    return t[c, :cols] if rows is None else t[rows[c], :cols]


def _kept(keep_mask: torch.Tensor, rows, c: slice, cols: int, local: torch.Tensor, owned: torch.Tensor
          ) -> torch.Tensor:
    """The keep mask of chunk `c`, with each row's target kept on the rank that owns it (a new tensor)."""
    kept = _read(keep_mask, rows, c, cols).clone()
    target = local[c].unsqueeze(-1)
    return kept.scatter_(-1, target, kept.gather(-1, target) | owned[c].unsqueeze(-1))


def _scaled(block: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """A new `dtype` tensor block / temperature (never a view of the logits)."""
    return block.to(dtype, copy=True).div_(temperature)


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _all_reduce_if_initialized(tensor: torch.Tensor, op, group) -> None:
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
    _all_reduce_if_initialized(row_max, dist.ReduceOp.MAX, group)
    shifted = logits - row_max
    target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1, keepdim=True)
    _all_reduce_if_initialized(sum_exp, dist.ReduceOp.SUM, group)
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
        _all_reduce_if_initialized(target_logit, dist.ReduceOp.SUM, group)
        log_prob = target_logit - sum_exp.log()

        entropy = p_entropy = sum_p_x = x.new_zeros(0)
        if with_entropy:
            if keep_mask is None:  # the log-prob's distribution is the full one
                sum_exp_e, p_entropy, max_e = sum_exp, p_log_prob, row_max
            else:
                _, sum_exp_e, p_entropy, max_e = _softmax_over_shards(x, local_targets, group)
            sum_p_x = (p_entropy * x).sum(dim=-1, keepdim=True)
            _all_reduce_if_initialized(sum_p_x, dist.ReduceOp.SUM, group)
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
    """slime's call, in slime's reduction order (slime's own tests hold it to an unfused reference at 1e-8, which
    the chunked kernel above meets only to rounding): log-probs `[N, 1]` of `tokens` [N] under softmax(logits)
    and, with `with_entropy`, the entropy `[N]`, from
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
