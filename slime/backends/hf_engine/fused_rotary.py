"""Rotary position embedding as one kernel per tensor in the hf engine on CUDA.

transformers' `apply_rotary_pos_emb` (Qwen, Llama and the models copied from them) rotates the query and the key
op by op: `q * cos`, a `rotate_half` (two slices, a negation and a concatenation) times `sin`, and their sum,
about ten kernels a layer for q and k. In a decode step of a small model, which is bound by its kernel count and
not by bandwidth (benchmarks/README.md, `decode_speed.py --profile`), that is about as many kernels as the rest of
the layer's element-wise work. The Triton kernel below reads each half of a head's vector, its cos and sin once,
computes both rotated halves in fp32 and rounds once to the input's dtype (transformers rounds after each
product and the sum: at most about one unit in the last place apart).

`fuse_rotary(model)` replaces the function in each modeling module the model's layers come from, after checking
on random inputs on the model's device that the module's own function computes the same (a model whose
`apply_rotary_pos_emb` rotates another way, e.g. interleaved or on part of the head, keeps its own). The
replacement calls the module's own function for anything the kernel does not cover: tensors off CUDA (unless
Triton's interpreter runs), another `unsqueeze_dim`, cos / sin narrower than the head, or dtypes that differ.
Models whose attention calls another function (Qwen2.5-VL's multimodal rotary) are not touched.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no fused rotary; transformers' function serves
    triton = None

logger = logging.getLogger("slime.hf_engine")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FUNCTION = "apply_rotary_pos_emb"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:

    @triton.jit
    def _rotary_kernel(x, cos, sin, out, seq, heads, sx_b, sx_h, sx_s, so_b, so_h, so_s, sc_b, sc_s,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """One program per (token, block of heads): out = x * cos + rotate_half(x) * sin. The last dimension of
        x, out, cos and sin is contiguous."""
        token = tl.program_id(0)
        b = token // seq
        s = token % seq
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        dm = d < HALF
        m = (h < heads) & dm
        angle = b * sc_b + s * sc_s
        c1 = tl.load(cos + angle + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(cos + angle + HALF + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(sin + angle + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(sin + angle + HALF + d, mask=dm, other=0.0).to(tl.float32)
        src = x + b * sx_b + h * sx_h + s * sx_s
        x1 = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=m, other=0.0).to(tl.float32)
        dst = out + b * so_b + h * so_h + s * so_s
        tl.store(dst + d, (x1 * c1 - x2 * s1).to(out.dtype.element_ty), mask=m)
        tl.store(dst + HALF + d, (x2 * c2 + x1 * s2).to(out.dtype.element_ty), mask=m)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] (any strides but a contiguous last dimension), cos / sin [B or 1, S, D] -> a new contiguous
    [B, H, S, D] tensor."""
    b, heads, seq, dim = x.shape
    out = torch.empty((b, heads, seq, dim), dtype=x.dtype, device=x.device)
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    grid = (b * seq, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](x, cos, sin, out, seq, heads, x.stride(0), x.stride(1), x.stride(2),
                         out.stride(0), out.stride(1), out.stride(2), sc_b, cos.stride(1),
                         HALF=half, BLOCK_H=block_h, BLOCK_D=block_d)
    return out


def _covered(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel computes what transformers' function does for these inputs."""
    if not (q.is_cuda or INTERPRETED) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    dim = q.shape[-1]
    if dim % 2 or k.shape[-1] != dim or cos.shape != sin.shape or cos.shape[-1] != dim:
        return False
    if q.dtype not in _DTYPES or not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        return False
    if not all(t.device == q.device and t.stride(-1) == 1 for t in (k, cos, sin)) or q.stride(-1) != 1:
        return False
    if cos.stride() != sin.stride() or cos.shape[0] not in (1, q.shape[0]) or q.shape[0] != k.shape[0]:
        return False
    return cos.shape[1] == q.shape[2] == k.shape[2]


def _fused(own):
    """`apply_rotary_pos_emb` through the kernel where it applies, else `own`."""
    unsqueeze_default = inspect.signature(own).parameters.get("unsqueeze_dim")
    default = unsqueeze_default.default if unsqueeze_default is not None else None

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", default)
        if args or set(kwargs) - {"unsqueeze_dim"} or unsqueeze_dim != 1 or not _covered(q, k, cos, sin):
            return own(q, k, cos, sin, *args, **kwargs)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    apply_rotary_pos_emb.own = own
    return apply_rotary_pos_emb


def _agrees(own, fused, shape: tuple[int, int, int], device, dtype) -> bool:
    """The module's own function and the kernel give the same rotation of random inputs, within a few units in the
    last place of `dtype` (of the largest input). `shape`: (query heads, key heads, head dim) of the model, so the kernel is compiled here
    for the shapes it will serve; q and k as transformers' attention makes them (transposed views)."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    k = torch.randn(2, 3, kv_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    angles = torch.rand(2, 3, head_dim // 2, generator=gen) * 6.3
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    with torch.no_grad():
        try:
            want = own(q, k, cos, sin)
        except (RuntimeError, TypeError, ValueError):
            return False  # not the rotation this kernel computes (another signature or layout)
        try:
            got = fused(q, k, cos, sin)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or run leaves transformers' form
            logger.warning("fused rotary embedding: the kernel failed (%s: %s); transformers' form is kept",
                           type(e).__name__, e)
            return False
    # rounding differs where the two products nearly cancel: the error is relative to the inputs, not the output
    atol = 4 * torch.finfo(dtype).eps * max(q.abs().max().item(), k.abs().max().item())
    return all(g.shape == w.shape and g.dtype == w.dtype
               and torch.allclose(g.float(), w.float(), rtol=0.0, atol=atol) for g, w in zip(got, want))


def _attention_shape(model) -> tuple[int, int, int] | None:
    """(query heads, key heads, head dim) of the model's language layers, or None."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(heads), int(getattr(config, "num_key_value_heads", None) or heads), int(head_dim)


def _modeling_modules(model: torch.nn.Module) -> list:
    """The Python modules that define `model`'s layers (where transformers keeps `apply_rotary_pos_emb`)."""
    names = sorted({type(m).__module__ for m in model.modules()})
    return [sys.modules[name] for name in names if name in sys.modules]


def fuse_rotary(model: torch.nn.Module) -> int:
    """Replace `apply_rotary_pos_emb` with the fused form in each modeling module of `model`'s layers where it
    computes the same; returns how many modules were changed."""
    shape = _attention_shape(model)
    param = next(model.parameters(), None)
    if triton is None or shape is None or param is None or param.dtype not in _DTYPES:
        return 0
    if not (param.is_cuda or INTERPRETED):
        return 0
    fused = kept = 0
    for module in _modeling_modules(model):
        own = getattr(module, FUNCTION, None)
        if own is None or not callable(own):
            continue
        own = getattr(own, "own", own)  # fused already (another model of this process)
        candidate = _fused(own)
        if _agrees(own, candidate, shape, param.device, param.dtype):
            setattr(module, FUNCTION, candidate)
            fused += 1
        else:
            kept += 1
    logger.info("rotary embedding: fused in %d modeling module(s), %d kept as they are", fused, kept)
    return fused


def restore_rotary(model: torch.nn.Module) -> None:
    """Undo `fuse_rotary` in the modeling modules of `model`'s layers (a benchmark compares both forms)."""
    for module in _modeling_modules(model):
        function = getattr(module, FUNCTION, None)
        if hasattr(function, "own"):
            setattr(module, FUNCTION, function.own)
