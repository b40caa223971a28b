"""Weights between HF checkpoints and a parallel megatron-core GPTModel.

A rank's parameter names are local: layer indices count from its pipeline stage's first layer and expert
indices from its expert-parallel rank's first expert. `global_name` turns them into the names of the
whole model (slime/backends/megatron_utils/converters/base.py), which the converters translate.

- `load_hf_weights`: every rank reads the HF safetensors, converts the whole state dict to Megatron
  names and copies in its own TP / EP shard of each parameter it holds.
- `iter_hf_weights`: collective over all ranks; yields (HF name, full tensor) pairs of the whole model,
  in a fixed order, on every rank: TP shards are all-gathered inside each stage, experts all-gathered
  over the EP group, and each pipeline stage broadcasts its tensors over the PP group in turn.

Simplifications: loading reads the full HF state dict on every rank (CPU memory bounded by the model
size); export materialises one pipeline stage's full tensors at a time on the device.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

from slime.backends.megatron_utils.converters import ConverterConfig, converter_for_hf_config
from slime.backends.megatron_utils.converters import tp as tp_layout
from slime.backends.megatron_utils.model import uses_te, unwrap
from slime.backends.megatron_utils.sandwich_norm import HF_STYLE_NAMES
from slime.backends.training import hf_save
from slime.utils.lora_adapter import is_adapter_name
from slime.weight_sync.frozen import frozen_parameter_names

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")


def _experts_per_rank(args) -> int:
    return (args.num_experts or 0) // args.expert_model_parallel_size


def global_name(gpt: torch.nn.Module, name: str, ep_rank: int, experts_per_rank: int) -> str:
    """A GPTModel parameter name with this rank's layer and expert offsets applied."""
    m = _LAYER.match(name)
    if not m:
        return name
    layer = gpt.decoder.layers[int(m.group(1))].layer_number - 1
    rest = HF_STYLE_NAMES.get(m.group(2), m.group(2))
    e = _EXPERT.match(rest)
    if e:
        rest = f"{e.group(1)}{ep_rank * experts_per_rank + int(e.group(2))}{e.group(3)}"
    return f"decoder.layers.{layer}.{rest}"


def named_parameters(model: list[torch.nn.Module], args, adapters: bool = False) -> list[tuple[str, str, torch.Tensor]]:
    """(local name, global name, tensor) of this rank's chunks, in module order: the parameters, and the
    MoE routers' `expert_bias` buffers (aux-loss-free balancing state, part of the checkpoint). The model's own
    weights, without LoRA adapters; `adapters=True`: the adapters' tensors only (megatron_utils/lora.py)."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    out = []
    for chunk in model:
        gpt = unwrap(chunk)
        tensors = list(gpt.named_parameters())
        tensors += [(n, b) for n, b in gpt.named_buffers() if n.endswith("router.expert_bias")]
        for name, t in tensors:
            if is_adapter_name(name) != adapters:
                continue
            out.append((name, global_name(gpt, name, ep_rank, _experts_per_rank(args)), t))
    return out


def _tp_rank_and_size(name: str) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if tp_layout.is_expert_param(name):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def read_hf_state_dict(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, all tensors of the *.safetensors files) of an HF model folder, on CPU."""
    from safetensors.torch import load_file

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"--hf-checkpoint {path}: not an HF model folder (no config.json there)")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"--hf-checkpoint {path}: no *.safetensors weights in the folder")
    with open(config_file) as f:
        config = json.load(f)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return config, tensors


@torch.no_grad()
def load_hf_weights(model: list[torch.nn.Module], args, path: str) -> None:
    """Copy this rank's shard of every parameter from the HF checkpoint at `path`."""
    config, hf = read_hf_state_dict(path)
    converter = converter_for_hf_config(config, args.model_name)
    full = converter.hf_to_megatron(hf, ConverterConfig.from_args(args), spec="te" if uses_te(args) else "local")
    del hf
    params = named_parameters(model, args)
    _check_all_used(full, {name for _, name, _ in params}, path, converter.name)
    for local, name, param in params:
        if name not in full:
            raise KeyError(f"{path}: the {converter.name} converter gives no tensor for Megatron parameter {name!r}; "
                           "do MODEL_ARGS match the checkpoint's config.json?")
        rank, size = _tp_rank_and_size(name)
        shard = tp_layout.shard(name, full[name], size, gated=args.swiglu)[rank]
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"{path}: {name} has shape {tuple(shard.shape)} for TP rank {rank}/{size}, but the "
                             f"model's {local} is {tuple(param.shape)}; do MODEL_ARGS match config.json?")
        param.copy_(shard.to(param.dtype))


def frozen_global_names(model: list[torch.nn.Module], args) -> set[str]:
    """Global names of this rank's parameters that do not train (the MoE routers' `expert_bias` buffers change
    during training: not parameters, never among them)."""
    return frozen_parameter_names((name, t) for _, name, t in named_parameters(model, args))


def _check_all_used(full: dict, mine: set[str], path: str, family: str) -> None:
    """Collective: every converted tensor must have a home on some rank (else weights would be dropped)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(mine))
    held = set().union(*everyone)
    unused = sorted(set(full) - held)
    if unused:
        raise ValueError(
            f"{path}: {len(unused)} tensor(s) of the {family} checkpoint have no parameter in this megatron-core "
            f"model, e.g. {unused[:4]}; this layer spec cannot hold them (do MODEL_ARGS match config.json?)"
        )


# ---- export --------------------------------------------------------------------------------------------------


def _gather_tp(name: str, t: torch.Tensor, gated: bool) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if tp_layout.shard_kind(name) == "replicated":
        return t
    expert = tp_layout.is_expert_param(name)
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return tp_layout.gather(name, shards, gated)


def _stage_tensors(model: list[torch.nn.Module], args, adapters: bool,
                   left_out: frozenset[str] = frozenset()) -> list[tuple[str, torch.Tensor]]:
    """This stage's parameters (or LoRA adapters) as full tensors with global names (TP and EP gathered), but
    those whose global name is in `left_out`. Collective."""
    from megatron.core import parallel_state as ps

    ep, per_rank = args.expert_model_parallel_size, _experts_per_rank(args)
    out = []
    for _, name, param in named_parameters(model, args, adapters):
        if name in left_out:
            continue
        full = _gather_tp(name, param.detach(), args.swiglu)
        e = _LAYER.match(name) and _EXPERT.match(name)
        if e and ep > 1:
            parts = [torch.empty_like(full) for _ in range(ep)]
            dist.all_gather(parts, full.contiguous(), group=ps.get_expert_model_parallel_group())
            local = int(e.group(2)) % per_rank
            out.extend((f"{e.group(1)}{r * per_rank + local}{e.group(3)}", t) for r, t in enumerate(parts))
        else:
            out.append((name, full))
    return out


def iter_megatron_weights(model: list[torch.nn.Module], args, adapters: bool = False,
                          left_out: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: (global Megatron name, full tensor) of the whole model on every rank, stage by stage, but the
    global names in `left_out`; with `adapters`, of its LoRA adapters instead."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    mine = _stage_tensors(model, args, adapters, left_out)
    if pp == 1:
        yield from mine
        return
    group, stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    for s in range(pp):
        src = dist.get_global_rank(group, s)
        meta = [[(n, tuple(t.shape), t.dtype) for n, t in mine] if s == stage else None]
        dist.broadcast_object_list(meta, src=src, group=group)
        device = mine[0][1].device if mine else torch.device("cpu")
        for i, (name, shape, dtype) in enumerate(meta[0]):
            t = mine[i][1].contiguous() if s == stage else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=src, group=group)
            yield name, t


def iter_hf_weights(model: list[torch.nn.Module], args, hf_config: dict,
                    left_out: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: (HF name, tensor) pairs of the whole model, converted per family; the Megatron parameters
    whose global names are in `left_out` are skipped."""
    converter = converter_for_hf_config(hf_config, args.model_name)
    cfg = ConverterConfig.from_args(args)
    for name, t in iter_megatron_weights(model, args, left_out=left_out):
        yield from converter.megatron_to_hf(name, t, cfg)


def save_hf_weights(model: list[torch.nn.Module], args, hf_config: dict, path: str) -> None:
    """Collective: the whole model as an HF folder at `path` (--save-hf), written by global rank 0: the converted
    weights as model.safetensors plus --hf-checkpoint's config and tokenizer files."""
    from safetensors.torch import save_file

    rank0 = dist.get_rank() == 0
    tensors = {}
    for name, t in iter_hf_weights(model, args, hf_config):
        if rank0:
            tensors[name] = t.detach().cpu().contiguous()
    if rank0:
        save_file(tensors, hf_save.prepare_hf_folder(path, args.hf_checkpoint), metadata={"format": "pt"})
    dist.barrier()
