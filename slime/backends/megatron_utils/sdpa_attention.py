"""Core attention of the Megatron backend when TransformerEngine is absent: torch's fused kernels.

megatron-core's local `DotProductAttention` materialises the [b, heads, s, s] score matrix in the model's
dtype and runs an unfused softmax; it also refuses packed (THD) micro-batches. `SDPAttention` takes its place
in the local layer spec (`megatron_utils.model`) with the same constructor and forward contract:

- padded micro-batches (`[s, b, heads, dim]`): `torch.nn.functional.scaled_dot_product_attention` with
  `is_causal=True` (flash / memory-efficient kernels on CUDA, never the s×s matrix);
- packed micro-batches (`[t, heads, dim]` with `PackedSeqParams(qkv_format="thd")`): each sequence attends
  causally within itself only, through torch's variable-length flash attention
  (`torch.nn.attention.varlen.varlen_attn`) on CUDA in bf16/fp16, else one SDPA call per sequence.

`--attention-kernel cudnn` (opt-in; `install`) puts cuDNN's fused attention first among SDPA's kernels: padded
micro-batches run it directly, and a packed micro-batch whose sequences, right-padded to the longest, add at most
half again to the causal attention's FLOPs (`padded_rows`) is attended as `[sequences, heads, longest, dim]`:
sequences of one length are that layout as they are (a view), others are padded by one copy (`pad_rows`) and
gathered back by another (`unpad_rows`), each the other's backward. Right padding leaves every real token's causal
output and gradients as they are, and torch's cuDNN kernel has no usable packed form (its packed entry point ran
~100x slower than flash in torch 2.11: benchmarks/attention_kernels.py). For its backward the padded copy keeps the
padded query, key, value and output and the gathered output: per token q + kv elements more than flash with q/k
norms (Qwen3), kv fewer without (Llama); the view keeps what flash keeps (config/plan/memory.py counts the larger).

Under context parallelism (cp > 1, packed only) each rank holds zigzag chunks of every sequence
(`cp_layout.py`): the keys and values of the whole CP group are gathered and each local query attends to the
keys of its sequence at positions up to its own, one SDPA call per sequence with an explicit mask.

Grouped-query attention runs without copying key/value heads (SDPA's `enable_gqa`; the flash kernels take
fewer key/value heads as they are), except under an explicit mask (context parallelism). Attention
dropout applies in training mode only (slime keeps the model in eval mode: recomputed and trained
log-probs must agree).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from slime.backends.megatron_utils.cp_layout import cp_group_size_rank, gather_cp, zigzag_layout

KERNELS = ("flash", "cudnn")  # --attention-kernel
PADDED_FLOPS_LIMIT = 1.5  # a packed micro-batch goes padded while padding adds at most this factor to its FLOPs
_CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]
_kernel = "flash"


def install(kernel: str) -> None:
    """Which fused attention this process's `SDPAttention` layers prefer (--attention-kernel)."""
    global _kernel
    if kernel not in KERNELS:
        raise ValueError(f"--attention-kernel {kernel!r}: one of {list(KERNELS)}")
    _kernel = kernel


def pads_packed() -> bool:
    """Whether packed micro-batches may take the padded route (--attention-kernel cudnn)."""
    return _kernel == "cudnn"


@dataclass(frozen=True)
class PaddedRows:
    """A packed micro-batch's sequences right-padded to the longest: `[sequences × longest]` rows, sequence i's
    tokens at the start of row i. `viewed`: every sequence is `longest` long, so the packed row is that layout as it
    is (viewed, not copied); `padded_rows` sets it, and a benchmark or test may clear it to time or tally the copy."""

    lengths: tuple[int, ...]
    viewed: bool

    @property
    def sequences(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths)


def padded_rows(cu_seqlens: list[int]) -> PaddedRows | None:
    """The padded layout of a packed micro-batch with boundaries `cu_seqlens`; None when right padding would add
    more than PADDED_FLOPS_LIMIT to the causal attention's FLOPs (one long sequence among short ones stays packed)."""
    lengths = tuple(end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]))
    if not lengths:
        return None
    longest = max(lengths)
    if len(lengths) * longest * longest > PADDED_FLOPS_LIMIT * sum(n * n for n in lengths):
        return None
    return PaddedRows(lengths, viewed=min(lengths) == longest)


def pad_rows(x: torch.Tensor, rows: PaddedRows) -> torch.Tensor:
    """Packed `[t, ...]` -> `[sequences × longest, ...]`, zeros after each sequence: one copy (`cat`)."""
    longest = rows.longest
    zeros = x.new_zeros(longest - min(rows.lengths), *x.shape[1:])
    pieces = []
    for piece, n in zip(x.split(rows.lengths), rows.lengths):
        pieces.append(piece)
        if n < longest:
            pieces.append(zeros[: longest - n])
    return torch.cat(pieces)


def unpad_rows(x: torch.Tensor, rows: PaddedRows) -> torch.Tensor:
    """`[sequences × longest, ...]` -> packed `[t, ...]`, the real tokens only: one copy (`cat`)."""
    longest = rows.longest
    return torch.cat(x.split([k for n in rows.lengths for k in (n, longest - n)])[::2])


def padded_causal(query, key, value, rows: PaddedRows, scale: float):
    """Causal attention of packed `[t, heads, dim]` sequences run on them right-padded to
    `[sequences, heads, longest, dim]` (zeros after each sequence), cuDNN's kernel first; `[t, heads, dim]` back."""

    sequences, longest = rows.sequences, rows.longest

    def pad(x):
        full = x if rows.viewed else _Relayout.apply(x, rows, True)
        return full.view(sequences, longest, *x.shape[1:]).transpose(1, 2)

    with sdpa_kernel(_CUDNN_FIRST, set_priority=True):
        out = F.scaled_dot_product_attention(pad(query), pad(key), pad(value), is_causal=True, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
    out = out.transpose(1, 2).flatten(0, 1)  # a view where the kernel wrote [sequences, longest, heads, dim]
    return out if rows.viewed else _Relayout.apply(out, rows, False)


@functools.cache
def _varlen_attn():
    """torch's varlen flash attention and the keywords this torch version takes, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


class SDPAttention(torch.nn.Module):
    """Causal self-attention over `[s, b, np, hn]` (padded) or `[t, np, hn]` (packed) query/key/value."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **_):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention: only causal self-attention is supported (got {attn_mask_type})")
        self.config = config
        self.layer_number = layer_number
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        # --apply-query-key-layer-scaling divides the scores by the layer number and the fp32 softmax multiplies
        # them back: no change to the result, so nothing to do here.
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SDPAttention: sliding-window attention (--window-size) needs TransformerEngine")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPAttention: --softmax-type {config.softmax_type} needs TransformerEngine")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            out = self._packed(query, key, value, packed_seq_params, dropout)
            return out.reshape(out.shape[0], -1)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._sdpa(q, k, v, attention_mask, dropout)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _sdpa(self, q, k, v, attention_mask, dropout):
        """[b, n, s, d] attention; `attention_mask` (megatron's convention: True = masked) replaces causality."""
        if attention_mask is None:
            with sdpa_kernel(_CUDNN_FIRST, set_priority=True) if _kernel == "cudnn" else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.scale,
                                                      enable_gqa=q.shape[1] != k.shape[1])
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(), dropout_p=dropout,
                                              scale=self.scale)

    def _packed(self, query, key, value, params, dropout):
        cu = params.cu_seqlens_q
        kv = params.cu_seqlens_kv
        if kv is not None and kv is not cu and not torch.equal(kv, cu):
            raise ValueError("SDPAttention: packed self-attention needs equal query and key/value boundaries")
        cp_size, cp_rank, cp_group = cp_group_size_rank()
        if cp_size > 1:
            return self._packed_cp(query, key, value, cu.tolist(), dropout, cp_size, cp_rank, cp_group)
        rows = getattr(params, "padded_rows", None)  # set by forward.packed_seq_params under --attention-kernel cudnn
        if rows is not None and dropout == 0:
            return padded_causal(query, key, value, rows, self.scale)
        varlen = _varlen_attn()
        if varlen is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0:
            fn, keywords = varlen
            if "scale" in keywords or math.isclose(self.scale, 1.0 / math.sqrt(query.shape[-1])):
                return varlen_causal(fn, keywords, query, key, value, cu, int(params.max_seqlen_q), self.scale)
        outs = []
        bounds = cu.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (x[start:end].permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
            outs.append(self._sdpa(q, k, v, None, dropout).squeeze(0).permute(1, 0, 2))
        return torch.cat(outs, dim=0)

    def _packed_cp(self, query, key, value, padded_cu, dropout, cp_size, cp_rank, cp_group):
        """This rank's queries `[t, np, hn]` (zigzag chunks of sequences with boundaries `padded_cu` in the
        padded row) against the keys / values of the whole CP group."""
        layout = zigzag_layout(tuple(padded_cu), cp_size, cp_rank, str(query.device))
        # keys and values of every rank, in one gather, back in padded-row order; their gradients are summed
        # back to the rank that owns them
        kv = gather_cp(torch.stack([key, value], dim=1), cp_group, sum_grad=True)[layout.gather_order]
        positions = layout.local_positions
        outs = []
        for i in range(len(padded_cu) - 1):
            lo, hi = layout.local_cu[i], layout.local_cu[i + 1]
            start, end = padded_cu[i], padded_cu[i + 1]
            q = query[lo:hi].permute(1, 0, 2).unsqueeze(0)
            k, v = (kv[start:end, j].permute(1, 0, 2).unsqueeze(0) for j in (0, 1))
            # megatron's convention: True = masked; a key later in the sequence than the query is masked
            masked = torch.arange(end - start, device=query.device).unsqueeze(0) > positions[lo:hi].unsqueeze(1)
            outs.append(self._sdpa(q, k, v, masked.unsqueeze(0).unsqueeze(0), dropout).squeeze(0).permute(1, 0, 2))
        return torch.cat(outs, dim=0)


class _Relayout(torch.autograd.Function):
    """`pad_rows` (`padding`) or `unpad_rows`, whose backward is the other: one copy each way, nothing kept but the
    layout (`index_copy` would keep the packed query, key and value besides their padded copies, and `index_select`'s
    backward adds into zeros with atomic additions; both ran slower than `cat` on an H100)."""

    @staticmethod
    def forward(ctx, x, rows: PaddedRows, padding: bool):
        ctx.rows, ctx.padding = rows, padding
        return pad_rows(x, rows) if padding else unpad_rows(x, rows)

    @staticmethod
    def backward(ctx, grad):
        return unpad_rows(grad, ctx.rows) if ctx.padding else pad_rows(grad, ctx.rows), None, None


def varlen_causal(fn, keywords: set, query, key, value, cu, max_len: int, scale: float):
    """Causal attention of packed `[t, heads, dim]` sequences with boundaries `cu` through torch's `varlen_attn`
    (`fn`, taking `keywords`), with the keywords this torch version has; fewer key/value heads than query heads
    go to torch's flash kernels directly where `varlen_attn` has no `enable_gqa`."""
    cu = cu.to(device=query.device, dtype=torch.int32)
    grouped = query.shape[1] != key.shape[1]
    if grouped and "enable_gqa" not in keywords:
        return _GroupedFlashVarlen.apply(query, key, value, cu, max_len, scale)
    kwargs = {"enable_gqa": True} if grouped else {}
    if "scale" in keywords:
        kwargs["scale"] = scale
    if "window_size" in keywords:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    return fn(query, key, value, cu, cu, max_len, max_len, **kwargs)


class _GroupedFlashVarlen(torch.autograd.Function):
    """Causal varlen flash attention with fewer key/value heads than query heads, straight through torch's flash
    kernels (FlashAttention-2 reads each key/value head for its group of query heads and sums their gradients):
    what `varlen_attn(enable_gqa=True)` does in torch versions that have it, without copying the key/value heads
    (4x their bytes for Qwen3's 32/8 heads, kept for backward) as repeating them would."""

    @staticmethod
    def forward(ctx, query, key, value, cu, max_len: int, scale: float):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            query, key, value, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse, cu, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), query, key, value, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, seed,
            offset, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def with_sdpa_attention(block_spec):
    """The decoder block spec (a modified copy) with `SDPAttention` as every layer's core attention in place of
    megatron-core's local `DotProductAttention`."""
    import copy

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    block_spec = copy.copy(block_spec)
    layers = []
    for layer in block_spec.layer_specs:
        attention = getattr(layer.submodules, "self_attention", None)
        inner = getattr(attention, "submodules", None)
        if getattr(inner, "core_attention", None) is DotProductAttention:
            layer = copy.copy(layer)
            layer.submodules = copy.copy(layer.submodules)
            layer.submodules.self_attention = attention = copy.copy(attention)
            attention.submodules = copy.copy(inner)
            attention.submodules.core_attention = SDPAttention
        layers.append(layer)
    block_spec.layer_specs = layers
    return block_spec
