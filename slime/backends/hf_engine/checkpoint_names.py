"""Weight names as a checkpoint spells them -> the served model's parameter names.

A pushed tensor may be named as the model's checkpoint on the Hub names it (what SGLang loads, and what the
Megatron trainer's converters export: Qwen2.5-VL's `model.layers.*`, `visual.*`, `lm_head.*`) or as the
transformers model names its parameters in memory (what the fsdp trainer pushes: `model.language_model.*`,
`model.visual.*`). transformers renames checkpoint keys on load with the key renamings it registers for the model
class (`transformers.conversion_mapping.get_model_conversion_mapping`); `checkpoint_name_mapper` applies those same
renamings, so both spellings load.

transformers also registers conversions that change the tensors (`WeightConverter`): a MoE model (qwen3_moe, glm4_moe,
deepseek_v3) holds its experts fused, `mlp.experts.gate_up_proj` [E, 2I, H] (experts stacked, gate then up) and
`mlp.experts.down_proj` [E, H, I], where the checkpoint has `mlp.experts.{e}.{gate,up,down}_proj.weight`.
`checkpoint_slices` finds, for every parameter such a conversion produces, which checkpoint keys are parts of it and
where: it reverts the conversions (`revert_weight_conversion`, what `save_pretrained` does) on meta tensors laid out as
the parameters are, with the layout copies in it (`contiguous()`, `clone()`) taken as views (they keep the values),
and keeps each key that comes back as a view of one parameter as that view's place (`Slice`). Only a parameter that
its views tile exactly (disjoint, every element covered) gets slices, so loading every slice loads the whole
parameter; a conversion whose reversal computes new values (a permutation for RoPE, a conv reshape, anything that
writes in place) gives no slices, and its keys stay unknown to the engine (answered 400 naming them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger("slime.hf_engine")
MAX_INTERVALS = 1 << 20  # a view spread over more contiguous runs than this is not checked, and not used
LAYOUT_COPIES = (torch.Tensor.contiguous, torch.Tensor.clone, torch.clone)
INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                   "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


def checkpoint_name_mapper(model: torch.nn.Module, names: set[str]) -> Callable[[str], str]:
    """A function name -> the model's name for it: `name` itself when the model has it (`names`), else the
    checkpoint key renamed as transformers renames it when loading this model class (unchanged if no renaming
    applies, so an unknown name stays unknown)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    prefix = getattr(model, "base_model_prefix", None) or None
    known = dict.fromkeys(names, True)  # rename_source_key asks `.get(name) is not None` to add/strip the prefix

    def to_model_name(name: str) -> str:
        if name in names:
            return name
        return rename_source_key(name, renamings, [], prefix, known)[0]

    return to_model_name


@dataclass(frozen=True)
class Slice:
    """A checkpoint key's place in one of the model's parameters: the view `as_strided(size, stride, the parameter's
    storage offset + offset)` of the parameter (its layout at start-up, which a release/resume keeps)."""

    param: str  # the model's name of the parameter
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the parameter's first element in its storage

    def of(self, param: torch.Tensor) -> torch.Tensor:
        """The view of `param`'s current memory (take it anew each time: a release/resume swaps `param.data`)."""
        return param.as_strided(self.size, self.stride, param.storage_offset() + self.offset)


def checkpoint_slices(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, Slice]:
    """{checkpoint key: Slice} for every key that a registered WeightConverter maps into a part of one of `tensors`
    (the model's parameters and buffers by name), for the parameters its views tile exactly. Empty when the model
    registers no such conversion, or when reverting it fails (logged; those keys then stay unknown)."""
    from transformers.core_model_loading import revert_weight_conversion

    meta = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for n, t in tensors.items()}
    trace = _LayoutCopiesAsViews()
    try:
        with trace:
            reverted = revert_weight_conversion(model, meta)
    except Exception as e:  # an op that needs real values or a config attribute: no slices, the keys stay unknown
        logger.warning("reverting %s's weight conversions on meta tensors failed (%s: %s): checkpoint keys that a "
                       "conversion maps into parts of parameters cannot be loaded by name", type(model).__name__,
                       type(e).__name__, e)
        return {}
    if trace.wrote:
        logger.warning("reverting %s's weight conversions writes in place (%s): checkpoint keys that a conversion "
                       "maps into parts of parameters cannot be loaded by name", type(model).__name__,
                       sorted(set(trace.wrote)))
        return {}
    owner = {id(t): n for n, t in meta.items()}
    found: dict[str, dict[str, Slice]] = {}  # parameter -> {key: its slice}
    for key, t in reverted.items():
        if not isinstance(t, torch.Tensor) or id(t) in owner:  # a parameter under its own or a renamed name
            continue
        base = t._base if t._is_view() else None
        param = owner.get(id(base))
        if param is None:  # a new tensor (a copy): no place in any parameter
            continue
        offset = t.storage_offset() - base.storage_offset()
        found.setdefault(param, {})[key] = Slice(param, tuple(t.shape), tuple(t.stride()), offset)
    slices = {}
    for param, parts in found.items():
        p = meta[param]
        if _tiles((0, tuple(p.shape), tuple(p.stride())), [(s.offset, s.size, s.stride) for s in parts.values()]):
            slices.update(parts)
        else:
            logger.warning("%s: the checkpoint keys %s do not cover it exactly once; they cannot be loaded by name",
                           param, sorted(parts)[:3])
    return slices


class _LayoutCopiesAsViews(TorchFunctionMode):
    """Inside it `contiguous()` / `clone()` return a view of their input (the same values in the input's layout), so a
    reversal made of views and layout copies hands back views of the parameter it reverts; in-place writes are
    noted in `wrote` (a view of a parameter that was written to holds other values than the parameter)."""

    def __init__(self):
        super().__init__()
        self.wrote: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in LAYOUT_COPIES:
            return args[0].view(args[0].shape)
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.startswith("__") or name in INPLACE_DUNDERS
        if in_place or kwargs.get("out") is not None:
            self.wrote.append(name)
        return func(*args, **kwargs)


def _runs(offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> list[tuple[int, int]] | None:
    """The elements of the view (offset, size, stride) as contiguous runs (start, length), or None when that takes more
    than MAX_INTERVALS runs or a dimension of stride 0 repeats elements."""
    dims = sorted(((n, s) for n, s in zip(size, stride) if n != 1), key=lambda d: d[1])
    if any(n == 0 for n, _ in dims):
        return []
    if any(s == 0 for _, s in dims):
        return None
    run, outer = 1, []
    for n, s in dims:  # innermost dimensions that continue the run of the ones below make it longer
        if not outer and s == run:
            run *= n
        else:
            outer.append((n, s))
    count = 1
    for n, _ in outer:
        count *= n
    if count > MAX_INTERVALS:
        return None
    starts = torch.full((1,), offset, dtype=torch.long)
    for n, s in outer:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.long)[None, :] * s).reshape(-1)
    return [(int(a), run) for a in starts.tolist()]


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """Sorted runs with adjacent ones joined, or None when two overlap."""
    out: list[tuple[int, int]] = []
    for start, n in sorted(runs):
        if out and start < out[-1][0] + out[-1][1]:
            return None
        if out and start == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return out


def _tiles(whole: tuple, parts: list[tuple]) -> bool:
    """Whether the views `parts` ((offset, size, stride) each) cover the elements of the view `whole` exactly once."""
    runs = [_runs(*v) for v in parts]
    target = _runs(*whole)
    if target is None or any(r is None for r in runs):
        return False
    return _merged([x for r in runs for x in r]) == _merged(target)
