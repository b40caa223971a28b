"""A LoRA adapter's names and PEFT folder format, shared by both trainers, the engines, the weight push and the
configuration (docs/lora.md).

An adapter's tensors are named after the model's HF modules: `<module>.lora_A.weight` (r × in) and
`<module>.lora_B.weight` (out × r), under PEFT's `base_model.model.` prefix in a PEFT folder. A PEFT adapter folder
holds `adapter_model.safetensors` and `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, ...), what
SGLang's LoRA loader and PEFT read. A save's iteration folder keeps its adapter in the `adapter/` subfolder.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ALL_LINEAR = "all-linear"
ADAPTER_DIR = "adapter"  # a save's iteration folder: the PEFT adapter beside the base model's files
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "slime_lora"  # the engines hold the trainer's adapter under it; rollout requests name it (lora_path)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@contextlib.contextmanager
def adapters_switched_off(layers: Iterable[Any]):
    """The adapted `layers` compute their frozen base alone while the context runs (each reads its `lora_off`),
    then add their adapters again: the KL term's reference pass on either trainer."""
    layers = list(layers)
    for layer in layers:
        layer.lora_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_off = False


def module_names(text: str | None) -> list[str]:
    """`--target-modules "q_proj, v_proj"` -> `["q_proj", "v_proj"]`."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def request_adapter(args: Any) -> str | None:
    """The `lora_path` a rollout's /generate names once the trainer has pushed its adapter: ADAPTER_NAME with
    --lora-rank, None without LoRA."""
    return ADAPTER_NAME if args.lora_rank > 0 else None


def engine_keeps_base_on_host(args: Any) -> bool:
    """A LoRA run whose engines release their weights (--offload-rollout, on with --colocate): each push sends only
    the adapter, so the engines keep a host copy of the frozen base and restore it on every resume (SGLang's
    --enable-weights-cpu-backup; the hf engine's --lora-base-cpu-backup). What miles' --lora-base-cpu-backup turns
    on; here it is the only way such a run works, so it is on whether or not that flag is given."""
    return args.lora_rank > 0 and bool(args.offload_rollout)


def engine_target_modules(target_modules: str, exclude_modules: str | None) -> list[str]:
    """SGLang's `--lora-target-modules` for --target-modules / --exclude-modules: `all` for all-linear (SGLang's
    word for every module it can adapt; the adapter it is then sent covers fewer), else the names left."""
    names = module_names(target_modules)
    if ALL_LINEAR in names:
        return ["all"]
    excluded = set(module_names(exclude_modules))
    return [n for n in names if n not in excluded]


def is_adapter_name(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def module_of(name: str) -> tuple[str, str]:
    """`base_model.model.model.layers.0.mlp.up_proj.lora_A.weight` -> (`model.layers.0.mlp.up_proj`, `A`)."""
    for suffix in ADAPTER_SUFFIXES:
        if name.endswith(suffix):
            return name.removeprefix(PEFT_PREFIX)[: -len(suffix)], suffix[len(".lora_")]
    raise ValueError(f"{name}: not a LoRA adapter tensor (names end with {' or '.join(ADAPTER_SUFFIXES)})")


def adapter_config(args: Any, modules: list[str], target_modules: list[str] | None = None) -> dict:
    """PEFT's adapter_config.json fields for this run's adapter (what SGLang's LoRA loader reads). `target_modules`:
    PEFT's list when the last parts of the module names are not enough (fsdp_utils.lora.peft_target_modules);
    by default those last parts."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.lora_rank, "lora_alpha": args.lora_alpha,
            "lora_dropout": args.lora_dropout, "bias": "none", "base_model_name_or_path": args.hf_checkpoint,
            "target_modules": target_modules or sorted({m.rsplit(".", 1)[-1] for m in modules})}


def peft_names(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {PEFT_PREFIX + name: t for name, t in named.items()}


def write_adapter_folder(state: dict[str, torch.Tensor], config: dict, path: str) -> int:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) from the adapter tensors of a full
    state dict; returns the bytes of tensors written."""
    from safetensors.torch import save_file  # imports torch: the engines' launchers read this module without it

    adapter = {n: t.contiguous() for n, t in peft_names({n: t for n, t in state.items() if is_adapter_name(n)}).items()}
    os.makedirs(path, exist_ok=True)
    save_file(adapter, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return sum(t.numel() * t.element_size() for t in adapter.values())
