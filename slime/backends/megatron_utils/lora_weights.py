"""The Megatron trainer's LoRA adapter under HF module names (PEFT's): for the engines, adapter folders and --save-hf.

A Megatron linear's adapter becomes one adapter per HF module it computes: each gets the same A and the rows of B
that produce that module's rows of the fused output. Which rows those are is asked of the model family's converter
itself (the weight push's own Megatron -> HF conversion, run on a column of row indices), so the adapter follows
the QKV group layout (GQA) and the gate/up split exactly as the weights do. Loading an HF adapter folder inverts it;
it needs the HF modules of one fused linear to share their A (as this trainer writes them): an adapter trained with
separate A's for q/k/v (the fsdp trainer's) is not one Megatron adapter and is refused.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from slime.backends.megatron_utils import weights
from slime.backends.megatron_utils.converters import ConverterConfig, converter_for_hf_config
from slime.backends.megatron_utils.converters import tp as tp_layout
from slime.backends.megatron_utils.lora import hf_target_names
from slime.backends.training import hf_save
from slime.utils.lora_adapter import ADAPTER_DIR, PEFT_PREFIX, write_adapter_folder
from slime.utils.lora_adapter import adapter_config as peft_config

_A, _B = ".lora_A.weight", ".lora_B.weight"


def hf_rows(converter, cfg: ConverterConfig, module: str, out_rows: int) -> list[tuple[str, torch.Tensor]]:
    """(HF module, indices of the Megatron output rows it takes) for the Megatron linear `module` (global name)."""
    index = torch.arange(out_rows, dtype=torch.float64).unsqueeze(1)
    return [(hf.removesuffix(".weight"), t.reshape(-1).long())
            for hf, t in converter.megatron_to_hf(module + ".weight", index, cfg)]


def adapter_hf_tensors(model: list[torch.nn.Module], args, hf_config: dict) -> list[tuple[str, torch.Tensor]]:
    """Collective: the whole adapter as (HF module + `.lora_A.weight` / `.lora_B.weight`, full tensor) pairs, on
    every rank (TP shards gathered, pipeline stages broadcast)."""
    converter = converter_for_hf_config(hf_config, args.model_name)
    cfg = ConverterConfig.from_args(args)
    full = dict(weights.iter_megatron_weights(model, args, adapters=True))
    out = []
    for name, a in full.items():
        if not name.endswith(_A):
            continue
        module = name[: -len(_A)]
        b = full[module + _B]
        for hf, rows in hf_rows(converter, cfg, module, b.shape[0]):
            out += [(hf + _A, a.clone()), (hf + _B, b[rows].contiguous())]
    return out


@torch.no_grad()
def load_adapter_folder(model: list[torch.nn.Module], args, hf_config: dict, path: str) -> int:
    """Copy a PEFT adapter folder (HF module names) into this rank's adapter shards; every adapter tensor of the
    run must be there with its shape, and nothing else. Returns the Megatron adapter tensors loaded."""
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--lora-adapter-path {path}: no adapter_model.safetensors there (a PEFT adapter "
                                "folder holds it and adapter_config.json)")
    _check_folder_config(path, args)
    loaded = {name.removeprefix(PEFT_PREFIX): t for name, t in load_file(file).items()}
    converter = converter_for_hf_config(hf_config, args.model_name)
    cfg = ConverterConfig.from_args(args)
    used: set[str] = set()
    params = weights.named_parameters(model, args, adapters=True)
    for _, name, param in params:
        module, half = (name[: -len(_A)], "A") if name.endswith(_A) else (name[: -len(_B)], "B")
        rank, size = weights._tp_rank_and_size(name)
        b_rows = (param.shape[0] * (size if tp_layout.shard_kind(module + _B) != "replicated" else 1)
                  if half == "B" else _b_rows(params, module, size))
        parts = hf_rows(converter, cfg, module, b_rows)
        tensors = []
        for hf, _ in parts:
            key = f"{hf}.lora_{half}.weight"
            if key not in loaded:
                raise ValueError(f"--lora-adapter-path {path}: no {key} there; the folder's adapter must cover this "
                                 f"run's --target-modules {args.target_modules} (it has "
                                 f"{len(loaded)} tensors, e.g. {sorted(loaded)[:2]})")
            tensors.append(loaded[key])
            used.add(key)
        if half == "A":
            if any(not torch.equal(t, tensors[0]) for t in tensors[1:]):
                raise ValueError(f"--lora-adapter-path {path}: {', '.join(hf for hf, _ in parts)} have different "
                                 f"lora_A; the Megatron trainer computes them in one fused layer ({module}) with one A "
                                 "shared by all; this adapter (trained on separate modules) loads only with "
                                 "--train-backend fsdp")
            full = tensors[0]
        else:
            full = torch.empty(b_rows, tensors[0].shape[1], dtype=tensors[0].dtype)
            for (_, rows), t in zip(parts, tensors):
                if t.shape[0] != rows.numel():
                    raise ValueError(f"--lora-adapter-path {path}: {module}: an HF part of B has {t.shape[0]} rows, "
                                     f"expected {rows.numel()}; is the adapter for this model?")
                full[rows] = t
        shard = tp_layout.shard(name, full, size, gated=args.swiglu)[rank]
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"--lora-adapter-path {path}: {name} has shape {tuple(shard.shape)} on TP rank "
                             f"{rank}/{size}, this run's is {tuple(param.shape)}; does --lora-rank match its r?")
        param.copy_(shard.to(param.dtype))
    extra = sorted(set(loaded) - used)
    mine = _everyone(extra)
    if mine:
        raise ValueError(f"--lora-adapter-path {path}: {len(mine)} tensor(s) for modules this run does not adapt, "
                         f"e.g. {mine[:3]}; pass --target-modules covering them")
    return len(params)


def _check_folder_config(path: str, args) -> None:
    """The folder's adapter_config.json (when there is one) must have the run's rank and alpha: the same tensors
    under another alpha / r scale would be another model."""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        return
    with open(config_file) as f:
        config = json.load(f)
    for key, flag, mine in (("r", "--lora-rank", args.lora_rank), ("lora_alpha", "--lora-alpha", args.lora_alpha)):
        if key in config and config[key] != mine:
            raise ValueError(f"--lora-adapter-path {path}: its adapter_config.json has {key} {config[key]}, the run "
                             f"{flag} {mine}; pass {flag} {config[key]}")


def _b_rows(params, module: str, size: int) -> int:
    """The full output rows of `module` (from its B on this rank)."""
    for _, name, p in params:
        if name == module + _B:
            return p.shape[0] * (size if tp_layout.shard_kind(name) != "replicated" else 1)
    raise KeyError(f"{module}: lora_A without lora_B")


def _everyone(names: list[str]) -> list[str]:
    """The names left unused on every rank (each stage uses its own layers' tensors). Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return names
    all_: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_, set(names))
    return sorted(set.intersection(*all_))


def write_adapter(model: list[torch.nn.Module], args, hf_config: dict, config: dict, path: str) -> None:
    """Collective: the adapter as a PEFT folder at `path` (HF module names), written by global rank 0."""
    named = adapter_hf_tensors(model, args, hf_config)
    if dist.get_rank() == 0:
        write_adapter_folder(dict(named), config, path)
    dist.barrier()


@torch.no_grad()
def save_hf_merged(model: list[torch.nn.Module], args, hf_config: dict, config: dict, path: str) -> None:
    """Collective: --save-hf with LoRA: the base with the adapter merged in (`W + (alpha / r) B A`, what the engines
    serve) as an HF folder at `path`, and the PEFT adapter folder in its `adapter/`; written by global rank 0."""
    from safetensors.torch import save_file

    adapter = dict(adapter_hf_tensors(model, args, hf_config))
    rank0 = dist.get_rank() == 0
    scaling = args.lora_alpha / args.lora_rank
    tensors = {}
    for name, t in weights.iter_hf_weights(model, args, hf_config):
        if not rank0:
            continue
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module + _A in adapter:
            a, b = adapter[module + _A].float(), adapter[module + _B].float()
            t = (t.float() + scaling * (b @ a)).to(t.dtype)
        tensors[name] = t.detach().cpu().contiguous()
    if rank0:
        save_file(tensors, hf_save.prepare_hf_folder(path, args.hf_checkpoint), metadata={"format": "pt"})
        write_adapter_folder(adapter, config, os.path.join(path, ADAPTER_DIR))
    dist.barrier()


def adapter_config(args: Any, linears: list[str]) -> dict:
    """PEFT's adapter_config.json fields for the Megatron run's adapter (HF module names)."""
    return peft_config(args, hf_target_names(linears))
