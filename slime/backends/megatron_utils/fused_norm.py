"""RMSNorm of the Megatron trainer as one Triton kernel forward and one backward (`--norm-kernel triton`).

Without TransformerEngine or apex megatron-core's local layer spec norms with torch's `RMSNorm`
(`WrappedTorchNorm`): a fused forward, but a backward of several kernels (the input's gradient, then the weight's
reduced by a LayerNorm kernel of its own). The 4B shape's profiled train step on an H100 spent 12% of its kernel time
there (benchmarks/README.md: 0.26 s of 2.11 s for the input, post-attention, q and k norms of 18 layers), about
twice what reading and writing the tensors takes. Here the forward is one program per block of rows (x read once,
y and each row's 1/rms written; fp32 arithmetic, one rounding), and the backward one persistent program per block of
rows in turn: the input's gradient of each row, and the weight's gradient summed over the rows it visits in fp32
registers, the programs' partial sums added by one reduction at the end.

`FusedRMSNorm` takes `WrappedTorchNorm`'s arguments and has its one parameter, `weight` (so checkpoints, converters
and weight pushes see the same names); `with_fused_norms` puts it in place of `WrappedTorchNorm` throughout a
decoder block spec (the layers' norms, the q/k norms, GLM-4's sandwich norms, the final norm). A model whose
normalization is not RMSNorm, or with zero-centred gamma, keeps torch's norm. Under `--sequence-parallel` its
weight is marked as `SequenceParallelTorchNorm`'s is, for megatron-core's reduction of its gradient.
"""

from __future__ import annotations

import os

import torch

from slime.backends.megatron_utils.sequence_parallel_norm import SequenceParallelTorchNorm, swap_classes

try:
    import triton
    import triton.language as tl
except ImportError:  # refused at parse time (--norm-kernel triton needs triton)
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_ELEMENTS = 8192  # elements of x a program holds at once: rows x the next power of two of the hidden size

if triton is not None:

    @triton.jit
    def _forward_kernel(x, w, y, rstd, rows, N: tl.constexpr, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        c = tl.arange(0, BLOCK_N)[None, :]
        m = (r < rows) & (c < N)
        xs = tl.load(x + r * N + c, mask=m, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=1) / N + eps)
        ws = tl.load(w + c, mask=c < N, other=0.0).to(tl.float32)
        tl.store(y + r * N + c, (xs * inv[:, None] * ws).to(y.dtype.element_ty), mask=m)
        rr = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(rstd + rr, inv, mask=rr < rows)

    @triton.jit
    def _backward_kernel(dy, x, w, rstd, dx, dw_parts, rows, blocks, programs, N: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WEIGHT_GRAD: tl.constexpr):
        pid = tl.program_id(0)
        c = tl.arange(0, BLOCK_N)[None, :]
        ws = tl.load(w + c, mask=c < N, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for block in range(pid, blocks, programs):
            r = block * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
            m = (r < rows) & (c < N)
            xs = tl.load(x + r * N + c, mask=m, other=0.0).to(tl.float32)
            g = tl.load(dy + r * N + c, mask=m, other=0.0).to(tl.float32)
            inv = tl.load(rstd + r, mask=r < rows, other=0.0)
            xhat = xs * inv
            gw = g * ws
            dot = tl.sum(gw * xhat, axis=1)[:, None] / N
            tl.store(dx + r * N + c, ((gw - xhat * dot) * inv).to(dx.dtype.element_ty), mask=m)
            if WEIGHT_GRAD:
                acc += g * xhat
        if WEIGHT_GRAD:
            cc = tl.arange(0, BLOCK_N)
            tl.store(dw_parts + pid * N + cc, tl.sum(acc, axis=0), mask=cc < N)


def _blocks(rows: int, n: int) -> tuple[int, int, int]:
    """Rows and columns of a program's tile, and its warps (16 elements of each tile array per thread)."""
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(BLOCK_ELEMENTS // block_n, triton.next_power_of_2(max(rows, 1))))
    return block_m, block_n, max(1, min(16, block_m * block_n // 512))


def _programs(blocks: int, device: torch.device) -> int:
    """Programs of the backward: a few per multiprocessor (each keeps a partial weight gradient), at most one per
    block of rows."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(blocks, 4 * sms))
    return max(1, min(blocks, 4))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        n = x.shape[-1]
        x2 = x.reshape(-1, n)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        rows = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            block_m, block_n, warps = _blocks(rows, n)
            _forward_kernel[(triton.cdiv(rows, block_m),)](x2, weight, y, rstd, rows, N=n, eps=float(eps),
                                                           BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, rstd = ctx.saved_tensors
        rows, n = x2.shape
        g2 = grad.reshape(-1, n)
        if not g2.is_contiguous():
            g2 = g2.contiguous()
        dx = torch.empty_like(x2)
        weight_grad = ctx.needs_input_grad[1]
        dw = None
        if rows:
            block_m, block_n, warps = _blocks(rows, n)
            blocks = triton.cdiv(rows, block_m)
            programs = _programs(blocks, x2.device)
            parts = torch.empty((programs, n) if weight_grad else (1,), dtype=torch.float32, device=x2.device)
            _backward_kernel[(programs,)](g2, x2, weight, rstd, dx, parts, rows, blocks, programs, N=n,
                                          BLOCK_M=block_m, BLOCK_N=block_n, WEIGHT_GRAD=weight_grad,
                                          num_warps=warps)
            if weight_grad:
                dw = parts.sum(0).to(weight.dtype)
        elif weight_grad:
            dw = torch.zeros_like(weight)
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * weight / sqrt(mean(x^2, -1) + eps), computed in fp32 and rounded once to x's dtype, with its gradients."""
    return _RMSNorm.apply(x, weight, eps)


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm through `rms_norm`, built from `WrappedTorchNorm`'s arguments (`__new__` hands back megatron-core's
    norm where this one does not apply: another normalization, zero-centred gamma)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            from megatron.core.transformer.torch_norm import WrappedTorchNorm

            torch_norm = SequenceParallelTorchNorm if config.sequence_parallel else WrappedTorchNorm
            return torch_norm(config, hidden_size, eps, **kwargs)
        return super().__new__(cls)

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda or INTERPRETED:
            return rms_norm(x, self.weight, self.eps)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # CPU ranks (the tests' shim)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def with_fused_norms(spec):
    """A copy of `spec` (a decoder block spec, a layer's ModuleSpec or any part of one) with every
    `WrappedTorchNorm` (or `SequenceParallelTorchNorm`) replaced by `FusedRMSNorm`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return swap_classes(spec, {WrappedTorchNorm: FusedRMSNorm, SequenceParallelTorchNorm: FusedRMSNorm})
