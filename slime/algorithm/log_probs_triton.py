"""`--log-probs-kernel triton`: log_probs.py's vocabulary kernel as two Triton kernels, one program per read row.

The chunked torch form (log_probs.py) makes ~15 elementwise passes over fp32 copies of each chunk of logits (read,
cast, scale, max, subtract, exp, sum, ... and as many in backward); on a 0.6B model at 151,936 words that was 34% of
the Megatron trainer's GPU time on an H100 (benchmarks/README.md). Here, per row of the logits, in fp32 registers:

    forward:  one read of the row: an online max / Σ exp(x - m) / Σ exp(x - m)·x over blocks of columns (the max
              rescales the sums as it grows), and x_target; across a vocabulary split over `group`, the ranks'
              (m, s, sx) are combined after the kernel: M = max m, s = Σ s·exp(m - M), sx likewise;
    backward: one read of the row and one write of its gradient, the formula of log_probs.py's docstring.

The same numbers as the torch form to fp32 rounding (the sums are accumulated in another order). The entry point is
`log_probs_and_entropy_triton`; the trainers take it or log_probs.py's `log_probs_and_entropy` through
`vocab_kernel(--log-probs-kernel)`. It takes no `keep_mask` (the top-p replay's calls keep the torch form); fp64
logits, logits off CUDA, or no triton are an error naming the flag. `rows` must be distinct (each read row's
gradient is written, not added). Needs CUDA logits, or `TRITON_INTERPRET=1` set before this module is imported (the
CPU tests run the kernels that way, in numpy).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from slime.algorithm.log_probs import KERNELS, local_targets, log_probs_and_entropy, mark_outputs, vocab_view

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch form serves; --log-probs-kernel triton is refused at parse time
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_BLOCK = 4096  # columns per step of a row's loop (fp32 registers per program)


def log_probs_and_entropy_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    rows: torch.Tensor | None = None,
    vocab_size: int | None = None,
    group=None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_probs.py's `log_probs_and_entropy` through the kernels below (no keep mask; `rows` distinct)."""
    problem = usable(logits)
    if problem:
        raise ValueError(f"--log-probs-kernel triton: {problem}; use --log-probs-kernel torch")
    v = vocab_view(logits, targets, rows, vocab_size, group, temperature)
    if v.rows is not None and v.rows.unique().numel() != v.rows.numel():
        raise ValueError("--log-probs-kernel triton: the rows read hold duplicates (each row's gradient is written "
                         "once); use --log-probs-kernel torch")
    local, owned = local_targets(v.targets, v.start, v.real, v.logits.shape[-1], group)
    log_probs, entropy = FusedLogProbs.apply(v.logits, v.rows, local, owned, float(temperature), v.real, with_entropy,
                                             entropy_grad, group)
    return log_probs.view(v.shape), (entropy.view(v.shape) if with_entropy else None)


def vocab_kernel(name: str):
    """--log-probs-kernel `name`: log_probs.py's `log_probs_and_entropy` (torch) or `log_probs_and_entropy_triton`,
    called the same way."""
    if name not in KERNELS:
        raise ValueError(f"--log-probs-kernel {name!r}: one of {list(KERNELS)}")
    return log_probs_and_entropy_triton if name == "triton" else log_probs_and_entropy


def usable(logits: torch.Tensor) -> str | None:
    """Why these logits cannot go through the Triton kernels, or None."""
    if triton is None:
        return "triton is not installed"
    if not (logits.is_cuda or INTERPRETED):
        return f"the logits are on {logits.device}, not a CUDA device"
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the logits are {logits.dtype} (the kernels compute in fp32)"
    return None


if triton is not None:

    @triton.jit
    def _row_of(rows, i, HAS_ROWS: tl.constexpr):
        """The row of the logits program `i` reads: `rows[i]`, or `i` when every row is read."""
        if HAS_ROWS:
            row = tl.load(rows + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        return row

    @triton.jit
    def _forward_kernel(logits, stride, rows, targets, owned, m_out, s_out, sx_out, xt_out, cols, inv_t,
                        HAS_ROWS: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        base = logits + _row_of(rows, i, HAS_ROWS) * stride
        m = float("-inf")
        s = 0.0
        sx = 0.0
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            real = offs < cols
            x = tl.load(base + offs, mask=real, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(x, 0))
            scale = tl.exp(m - m_new)
            e = tl.exp(x - m_new)
            s = s * scale + tl.sum(e, 0)
            if ENTROPY:
                sx = sx * scale + tl.sum(tl.where(real, e * x, 0.0), 0)
            m = m_new
        target = tl.load(targets + i).to(tl.int64)
        own = tl.load(owned + i) != 0
        xt = tl.where(own, tl.load(base + target).to(tl.float32) * inv_t, 0.0)
        tl.store(m_out + i, m)
        tl.store(s_out + i, s)
        tl.store(sx_out + i, sx)
        tl.store(xt_out + i, xt)

    @triton.jit
    def _backward_kernel(logits, stride, grad, grad_stride, rows, targets, owned, lse, mean_x, g_lp, g_ent, cols,
                         width, inv_t, HAS_ROWS: tl.constexpr, HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr,
                         BLOCK: tl.constexpr):
        i = tl.program_id(0)
        row = _row_of(rows, i, HAS_ROWS)
        base = logits + row * stride
        out = grad + row * grad_stride
        lse_i = tl.load(lse + i)
        target = tl.load(targets + i).to(tl.int64)
        own = tl.load(owned + i) != 0
        for start in range(0, width, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            real = offs < cols
            x = tl.load(base + offs, mask=real, other=0.0).to(tl.float32) * inv_t
            p = tl.exp(x - lse_i)
            g = tl.zeros([BLOCK], dtype=tl.float32)
            if HAS_LP:
                glp = tl.load(g_lp + i)
                g = g - glp * p + tl.where((offs == target) & own, glp, 0.0)
            if HAS_ENT:
                g = g - tl.load(g_ent + i) * p * (x - tl.load(mean_x + i))
            g = tl.where(real, g * inv_t, 0.0)
            tl.store(out + offs, g.to(grad.dtype.element_ty), mask=offs < width)


def _block(cols: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(max(cols, 16)))


class FusedLogProbs(torch.autograd.Function):
    """log_probs.py's `_LogProbs` without a keep mask, through the kernels above (same arguments and outputs)."""

    @staticmethod
    def forward(ctx, logits, rows, local, owned, temperature: float, cols: int, with_entropy: bool,
                entropy_grad: bool, group):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        n = logits.shape[0] if rows is None else rows.numel()
        dev = logits.device
        stats = torch.empty(4, n, dtype=torch.float32, device=dev)  # m, Σ exp(x - m), Σ exp(x - m)·x, x_target
        owned_u8 = owned.to(torch.uint8)
        if n:
            _forward_kernel[(n,)](logits, logits.stride(0), rows if rows is not None else local, local, owned_u8,
                                  stats[0], stats[1], stats[2], stats[3], cols, 1.0 / temperature,
                                  HAS_ROWS=rows is not None, ENTROPY=with_entropy, BLOCK=_block(cols), num_warps=8)
        m, s, sx, xt = stats
        if group is not None and dist.get_world_size(group) > 1:
            top = m.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            rescale = (m - top).exp()
            sums = torch.stack([s * rescale, sx * rescale, xt])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            m, (s, sx, xt) = top, sums
        lse = m + s.log()
        log_probs = xt - lse
        mean_x = sx / s
        entropy = lse - mean_x if with_entropy else torch.empty(0, dtype=torch.float32, device=dev)
        ctx.save_for_backward(logits, rows, local, owned_u8, lse, mean_x)
        ctx.temperature, ctx.cols = temperature, cols
        mark_outputs(ctx, entropy, with_entropy, entropy_grad)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, rows, local, owned, lse, mean_x = ctx.saved_tensors
        nothing = (None,) * 8
        with_entropy = bool(ctx.entropy_grad and grad_entropy is not None and grad_entropy.numel())
        if not ctx.cols or (grad_log_probs is None and not with_entropy):
            return torch.zeros_like(logits), *nothing
        # every element is written by the kernel when every row is read; otherwise the unread rows stay zero
        grad = torch.empty_like(logits) if rows is None else torch.zeros_like(logits)
        n = lse.numel()
        if n:
            _backward_kernel[(n,)](logits, logits.stride(0), grad, grad.stride(0), rows if rows is not None else local,
                                   local, owned, lse, mean_x,
                                   grad_log_probs.contiguous() if grad_log_probs is not None else lse,
                                   grad_entropy.contiguous() if with_entropy else lse, ctx.cols, logits.shape[-1],
                                   1.0 / ctx.temperature, HAS_ROWS=rows is not None,
                                   HAS_LP=grad_log_probs is not None, HAS_ENT=with_entropy,
                                   BLOCK=_block(logits.shape[-1]), num_warps=8)
        return grad, *nothing
