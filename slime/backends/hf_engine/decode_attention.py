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
    def _decode_kernel(q, k, v, mask, out, columns, scale, nk, nv, write_col,
                       sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, so_b, so_h, snk_b, snk_h, snv_b, snv_h,
                       GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                       PRECISION: tl.constexpr, WRITE: tl.constexpr):
        """One program per (row, KV head): out[row, 0, head] = softmax(q k^T * scale, masked) v for the GROUPS query
        heads of this KV head. WRITE: the step's new key and value (nk, nv) are first stored at the row's column
        write_col[row] of k and v, and attended from registers (the loop skips that column: a program's own store
        is not guaranteed visible to its loads)."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = kv_head * GROUPS + g
        live_g = g < GROUPS
        qv = tl.load(q + row * sq_b + heads[:, None] * sq_h + d[None, :], mask=live_g[:, None],
                     other=0.0).to(tl.float32)
        if WRITE:
            col = tl.load(write_col + row)
            kn = tl.load(nk + row * snk_b + kv_head * snk_h + d)
            vn = tl.load(nv + row * snv_b + kv_head * snv_h + d)
            tl.store(k + row * sk_b + kv_head * sk_h + col * sk_l + d, kn)
            tl.store(v + row * sv_b + kv_head * sv_h + col * sv_l + d, vn)
            m_i = tl.sum(qv * kn.to(tl.float32)[None, :], axis=1) * scale  # the new column's score: its weight is 1
            l_i = tl.full([G_PAD], 1.0, tl.float32)
            acc = tl.zeros([G_PAD, D], tl.float32) + vn.to(tl.float32)[None, :]
        else:
            col = -1
            m_i = tl.full([G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D], tl.float32)
        for start in range(0, columns, BLOCK):
            n = start + tl.arange(0, BLOCK)
            keep = (tl.load(mask + row * sm_b + n, mask=n < columns, other=0) != 0) & (n != col)
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


def covers_write(key: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor, columns: torch.Tensor) -> bool:
    """Whether the kernel can also store the step's new key / value ([B, KVH, 1, D] each, in the cache's dtype,
    last dimension contiguous) at each row's column `columns` ([B] integers) of the cache `key` is a view of."""
    b, kv_heads, _, d = key.shape
    shape = (b, kv_heads, 1, d)
    return (new_key.shape == shape and new_value.shape == shape and new_key.dtype == new_value.dtype == key.dtype
            and new_key.stride(-1) == 1 and new_value.stride(-1) == 1 and columns.shape == (b,)
            and not columns.is_floating_point() and columns.device == key.device)


def triton_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                            scale: float, write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                            ) -> torch.Tensor:
    """query [B, H, 1, D], key / value [B, KVH, L, D], mask [B, 1, 1, L] bool (`covered`) -> [B, 1, H, D].
    `write` (new key, new value, columns; `covers_write`): the kernel first stores them into key / value, each row's
    at its column (which the mask must keep), as the slot cache's indexed writes would."""
    b, h, _, d = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    groups = h // kv_heads
    out = torch.empty((b, 1, h, d), dtype=query.dtype, device=query.device)
    nk, nv, write_col = write if write is not None else (key, value, mask)  # unread without WRITE
    _decode_kernel[(b, kv_heads)](
        query, key, value, mask, out, columns, float(scale), nk, nv, write_col,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), out.stride(0), out.stride(2),
        nk.stride(0), nk.stride(1), nv.stride(0), nv.stride(1),
        GROUPS=groups, G_PAD=max(16, triton.next_power_of_2(groups)), D=d, BLOCK=BLOCK_N,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", WRITE=write is not None)
    return out
