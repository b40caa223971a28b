"""Decode attention of the slot cache as one Triton kernel that reads only each row's live columns
(`--decode-attention triton`; the default `auto` takes it wherever the slot cache runs on CUDA and triton imports).

The slot cache (slots.py) attends with SDPA over the whole column bucket of every row, under a boolean mask: each
decode step reads keys and values of every allocated column, live or not, and copies the query into SDPA's layout
and the output back out of it. On an H100, at batch 64 of a 0.6B model (benchmarks/README.md, `decode_speed.py
--profile`), that attention was 24 us per layer and step, the largest single kernel of the step. The kernel here
runs one program per (row, KV head): the row's query heads of that KV head (grouped-query models read each KV head
once) against its columns in blocks, with an online softmax in fp32, skipping every block the mask leaves empty,
and writes the output straight into transformers' [B, 1, H, D] layout. The slot cache's masks are prefixes (columns
0 .. len of the row), so the blocks read are the live ones plus at most one partial block.

Numerics: everything in fp32 after the loads. 16-bit queries, keys and values multiply on TF32 tensor cores (exact
products of bf16 / fp16 inputs; the probabilities keep TF32's 10 bits, more than flash attention's rounding to the
values' dtype), so bf16 outputs differ from SDPA's by about a unit in the last place; fp32 inputs multiply in IEEE
fp32 (no TF32). Anything the kernel does not cover (more than one query position, another mask shape, a head
dimension that is not a power of two from 16 to 256, tensors off CUDA unless Triton's interpreter runs) goes to SDPA.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # SDPA serves
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_N = 64  # columns per block
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:

    @triton.jit
    def _decode_kernel(q, k, v, mask, out, columns, scale,
                       sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, so_b, so_h,
                       GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                       PRECISION: tl.constexpr):
        """One program per (row, KV head): out[row, 0, head] = softmax(q k^T * scale, masked) v for the GROUPS query
        heads of this KV head."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = kv_head * GROUPS + g
        live_g = g < GROUPS
        qv = tl.load(q + row * sq_b + heads[:, None] * sq_h + d[None, :], mask=live_g[:, None],
                     other=0.0).to(tl.float32)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for start in range(0, columns, BLOCK):
            n = start + tl.arange(0, BLOCK)
            keep = tl.load(mask + row * sm_b + n, mask=n < columns, other=0) != 0
            if tl.sum(keep.to(tl.int32), axis=0) > 0:  # a block the mask leaves empty is not read
                kb = tl.load(k + row * sk_b + kv_head * sk_h + n[:, None] * sk_l + d[None, :], mask=keep[:, None],
                             other=0.0).to(tl.float32)
                s = tl.dot(qv, tl.trans(kb), input_precision=PRECISION)
                s = tl.where(keep[None, :], s * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vb = tl.load(v + row * sv_b + kv_head * sv_h + n[:, None] * sv_l + d[None, :], mask=keep[:, None],
                             other=0.0).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision=PRECISION)
                m_i = m_new
        result = acc / l_i[:, None]
        tl.store(out + row * so_b + heads[:, None] * so_h + d[None, :], result.to(out.dtype.element_ty),
                 mask=live_g[:, None])


def kernel_available() -> bool:
    """Whether triton imports (it comes with torch's CUDA builds)."""
    return triton is not None


def covered(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask) -> bool:
    """Whether the kernel computes this call: one query position, a [B, 1, 1, L] boolean mask, one dtype, a head
    dimension that is a power of two from 16 to 256, H a multiple of the KV heads, last dimensions contiguous."""
    if triton is None or not (query.is_cuda or INTERPRETED) or query.dim() != 4 or key.dim() != 4:
        return False
    b, h, q, d = query.shape
    if q != 1 or key.shape[0] != b or value.shape != key.shape or key.shape[-1] != d or h % key.shape[1]:
        return False
    if d < 16 or d > 256 or d & (d - 1) or query.dtype not in _DTYPES or not query.dtype == key.dtype == value.dtype:
        return False
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (b, 1, 1, key.shape[2]):
        return False
    return all(t.stride(-1) == 1 for t in (query, key, value, mask))


def triton_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """query [B, H, 1, D], key / value [B, KVH, L, D], mask [B, 1, 1, L] bool (`covered`) -> [B, 1, H, D]."""
    b, h, _, d = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    groups = h // kv_heads
    out = torch.empty((b, 1, h, d), dtype=query.dtype, device=query.device)
    _decode_kernel[(b, kv_heads)](
        query, key, value, mask, out, columns, float(scale),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), out.stride(0), out.stride(2),
        GROUPS=groups, G_PAD=max(16, triton.next_power_of_2(groups)), D=d, BLOCK=BLOCK_N,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    return out
