"""Log-probs and entropy of chosen tokens from vocab-parallel logits, without fp32 copies of the `[N, V]` block.

Every TP rank holds the logits of a contiguous vocabulary slice (Megatron pads the vocabulary at its end to a
multiple of 128 × TP; the padding columns are left out, so the distribution is the one the engine samples from).
The plain autograd form (select the response rows, `.float()`, divide by the temperature, shift, exponentiate,
...) kept several fp32 tensors of the logits' size alive until backward, ~20 B per logit. `VocabParallelLogProbs`
saves the logits as they are (the model's dtype), the rows it reads and three floats per row, and goes through the
rows in chunks of `CHUNK_ELEMENTS`, recomputing the softmax in backward. Per row, with x = logits / t over this
rank's real columns:

    pass 1: m = max x (all-reduced, MAX)
    pass 2: s = Σ exp(x - m), x_target (on the rank that owns it), Σ exp(x - m)·x (all-reduced together, SUM)
            lse = m + log s, log_prob = x_target - lse, E[x] = Σ exp(x - m)·x / s, entropy = lse - E[x]
    backward: p = exp(x - lse);  d/dx = g_lp · (onehot(target) - p) - g_ent · p · (x - E[x]);  d/dlogits = d/dx / t

Each rank's gradient is its own slice's (the outputs are the same on every TP rank, so nothing is reduced in
backward); rows that were not read get zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 26  # fp32 elements per chunk (256 MB)


class VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, targets, temperature: float, real_columns: int, column_start: int,
                with_entropy: bool, group):
        n = rows.numel()
        dtype = torch.promote_types(logits.dtype, torch.float32)
        dev = logits.device
        step = max(1, CHUNK_ELEMENTS // max(real_columns, 1))
        chunks = [slice(i, min(n, i + step)) for i in range(0, n, step)]
        local = targets - column_start
        owned = (local >= 0) & (local < real_columns)
        local = local.clamp(0, max(real_columns - 1, 0))

        row_max = torch.full((n,), float("-inf"), dtype=dtype, device=dev)
        if real_columns:
            for c in chunks:
                row_max[c] = logits[rows[c], :real_columns].to(dtype).amax(-1).div_(temperature)
        _all_reduce(row_max, dist.ReduceOp.MAX, group)

        sums = torch.zeros(3, n, dtype=dtype, device=dev)  # Σ exp(x - m), x_target, Σ exp(x - m)·x
        if real_columns:
            for c in chunks:
                x = _scaled(logits[rows[c], :real_columns], dtype, temperature)
                sums[1, c] = x.gather(-1, local[c].unsqueeze(-1)).squeeze(-1) * owned[c]
                e = x.sub(row_max[c].unsqueeze(-1)).exp_()
                sums[0, c] = e.sum(-1)
                if with_entropy:
                    sums[2, c] = e.mul_(x).sum(-1)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        lse = row_max + sums[0].log()
        log_probs = sums[1] - lse
        mean_x = sums[2] / sums[0]
        entropy = lse - mean_x if with_entropy else torch.empty(0, dtype=dtype, device=dev)

        ctx.save_for_backward(logits, rows, local, owned, lse, mean_x)
        ctx.temperature, ctx.real_columns, ctx.with_entropy, ctx.step = temperature, real_columns, with_entropy, step
        ctx.set_materialize_grads(False)  # an output left out of the loss gets None: its term is skipped
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, rows, local, owned, lse, mean_x = ctx.saved_tensors
        t, cols = ctx.temperature, ctx.real_columns
        grad = torch.zeros_like(logits)
        with_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel()
        if not cols or (grad_log_probs is None and not with_entropy):
            return grad, None, None, None, None, None, None, None
        dtype = lse.dtype
        for i in range(0, rows.numel(), ctx.step):
            c = slice(i, min(rows.numel(), i + ctx.step))
            x = _scaled(logits[rows[c], :cols], dtype, t)
            p = x.sub(lse[c].unsqueeze(-1)).exp_()
            if grad_log_probs is None:
                g = torch.zeros_like(p)
            else:
                g = p.mul(-grad_log_probs[c].unsqueeze(-1))
                g.scatter_add_(-1, local[c].unsqueeze(-1), (grad_log_probs[c] * owned[c]).unsqueeze(-1))
            if with_entropy:
                g.sub_(p.mul_(x.sub_(mean_x[c].unsqueeze(-1))).mul_(grad_entropy[c].unsqueeze(-1)))
            grad[rows[c], :cols] += g.div_(t).to(grad.dtype)
        return grad, None, None, None, None, None, None, None


def _scaled(block: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """A new `dtype` tensor block / temperature (never a view of the logits)."""
    return block.to(dtype, copy=True).div_(temperature)


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def chunked_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, with_entropy: bool = False,
                      temperature: float = 1.0, rows: torch.Tensor | None = None, group=None, tp_rank: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits[rows] / temperature)[target] (fp32) and, with `with_entropy`, the entropy, over the real
    vocabulary (`vocab_size`), for `logits` [T, V/tp] holding TP rank `tp_rank`'s slice (`group`: the TP group,
    None for one rank); `rows` [N] picks the rows (all of them by default). Differentiable in `logits`."""
    if temperature <= 0:
        raise ValueError(f"temperature {temperature}: must be > 0")
    if logits.dim() != 2:
        raise ValueError(f"logits of shape {tuple(logits.shape)}: expected [rows, vocabulary slice]")
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab
    real = min(local_vocab, max(0, vocab_size - start))
    rows = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows.to(logits.device).long()
    log_probs, entropy = VocabParallelLogProbs.apply(logits, rows, targets.to(logits.device).long(),
                                                     float(temperature), real, start, with_entropy, group)
    return log_probs, (entropy if with_entropy else None)


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, with_entropy: bool = False,
                             temperature: float = 1.0, rows: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunked_log_probs` over megatron-core's tensor-parallel group (this rank's vocabulary slice)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    return chunked_log_probs(logits, targets, vocab_size, with_entropy, temperature, rows, group,
                             ps.get_tensor_model_parallel_rank())
