"""Rotary embedding of packed (THD) micro-batches as one Triton kernel forward and one backward (`--rope-kernel
triton`; the default `auto` takes it where the Megatron trainer packs on CUDA with rope fusion on).

packed_rope.py rotates all tokens of a packed micro-batch in one call of megatron-core's `_apply_rotary_pos_emb_bshd`
(the per-token frequencies gathered first); that call is still a dozen element-wise kernels for the query and a
dozen for the key of every layer (cos and sin of the frequencies, their scaling and cast, `rotate_half`'s chunk,
negation and concatenation, two products, a sum, the concatenation with the unrotated part), and as many again in
the backward pass. On an H100, with the Triton log-prob kernel, `mul` and `cat` were 16% of the Megatron train
step's kernel time on a 0.6B model (benchmarks/README.md). Here one program per (token, block of heads) reads the
token's frequencies from megatron-core's table at its position, computes cos and sin in fp32, and rotates each
head's two halves with one rounding to the input's dtype (megatron-core rounds cos and sin to it, then each product:
about a unit in the last place apart; TransformerEngine's fused kernel also computes in fp32); the dimensions past
the rotated ones are copied. The backward pass is the same kernel with the transposed rotation.

Covered: rotate-half pairing (not `--rotary-interleaved`, not MLA's), a frequency table [P, 1, 1, R] with R even and
no larger than the head, bf16 / fp16 / fp32 tensors on CUDA (or under Triton's interpreter). Anything else keeps
megatron-core's function.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # megatron-core's function serves
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNELS = ("torch", "triton")  # --rope-kernel
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:

    @triton.jit
    def _rope_kernel(x, out, freqs, positions, heads, sx_t, sx_h, so_t, so_h, sf_p, mscale,
                     HALF: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_P: tl.constexpr, BACKWARD: tl.constexpr):
        """out = x rotated by the angles of row positions[token] of `freqs` (forward), or by their transpose (the
        gradient); dimensions 2 * HALF .. DIM copied."""
        token = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        dm = d < HALF
        m = (h < heads) & dm
        row = freqs + tl.load(positions + token) * sf_p
        a1 = tl.load(row + d, mask=dm, other=0.0).to(tl.float32)
        a2 = tl.load(row + HALF + d, mask=dm, other=0.0).to(tl.float32)
        c1, s1 = tl.cos(a1) * mscale, tl.sin(a1) * mscale
        c2, s2 = tl.cos(a2) * mscale, tl.sin(a2) * mscale
        src = x + token * sx_t + h * sx_h
        dst = out + token * so_t + h * so_h
        x1 = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=m, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(dst + d, y1.to(out.dtype.element_ty), mask=m)
        tl.store(dst + HALF + d, y2.to(out.dtype.element_ty), mask=m)
        if DIM > 2 * HALF:
            p = 2 * HALF + tl.arange(0, BLOCK_P)[None, :]
            pm = (h < heads) & (p < DIM)
            tl.store(dst + p, tl.load(src + p, mask=pm, other=0.0), mask=pm)


def _launch(x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, mscale: float,
            backward: bool) -> torch.Tensor:
    tokens, heads, dim = x.shape
    half = freqs.shape[-1] // 2
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
    block_p = triton.next_power_of_2(max(1, dim - 2 * half))
    grid = (tokens, triton.cdiv(heads, block_h))
    _rope_kernel[grid](x, out, freqs, positions, heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                       freqs.stride(0), float(mscale), HALF=half, DIM=dim, BLOCK_H=block_h, BLOCK_D=block_d,
                       BLOCK_P=block_p, BACKWARD=backward)
    return out


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, positions, mscale):
        ctx.save_for_backward(freqs, positions)
        ctx.mscale = mscale
        return _launch(t, freqs, positions, mscale, backward=False)

    @staticmethod
    def backward(ctx, grad):
        freqs, positions = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _launch(grad, freqs, positions, ctx.mscale, backward=True), None, None, None


def covered(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mla: bool) -> bool:
    """Whether the kernel computes megatron-core's rotation of `t` [T, H, D] by `freqs` [P, 1, 1, R]."""
    if triton is None or interleaved or mla or not (t.is_cuda or INTERPRETED):
        return False
    if t.dim() != 3 or freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        return False
    rot = freqs.shape[-1]
    if rot % 2 or rot > t.shape[-1] or t.dtype not in _DTYPES or freqs.device != t.device:
        return False
    return t.stride(-1) == 1 and freqs.stride(-1) == 1


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """`t` [T, H, D] rotated as megatron-core rotates it by `freqs[positions]` (`covered` says when), with its
    gradient; `positions` [T]: each token's row of the table."""
    return _FusedRope.apply(t, freqs.reshape(freqs.shape[0], freqs.shape[-1]), positions.to(torch.long), mscale)
