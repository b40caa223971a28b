"""Weight names as a checkpoint spells them -> the served model's parameter names.

A pushed tensor may be named as the model's checkpoint on the Hub names it (what SGLang loads, and what the
Megatron trainer's converters export: Qwen2.5-VL's `model.layers.*`, `visual.*`, `lm_head.*`) or as the
transformers model names its parameters in memory (what the fsdp trainer pushes: `model.language_model.*`,
`model.visual.*`). transformers renames checkpoint keys on load with the key renamings it registers for the model
class (`transformers.conversion_mapping.get_model_conversion_mapping`); `checkpoint_name_mapper` applies those same
renamings, so both spellings load. Only renamings are applied: a registered conversion that also changes the
tensors (e.g. fusing MoE experts) is not, and such names stay unknown to the engine (answered 400 naming them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
