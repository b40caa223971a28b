"""LoRA on the Megatron trainer: adapters on megatron-core's column- and row-parallel linears of the decoder.

An adapted linear computes its base output plus `(alpha / r) · B A x`, with B = 0 at the start (the model is the
base model) and the base frozen: only `lora_A.weight` / `lora_B.weight` require gradients, so megatron-core's DDP
gives only them gradient buffers and its optimizer only them state. Under tensor parallelism the adapter splits
with its layer (converters/tp.py):

- column-parallel (`linear_qkv`, `linear_fc1`): A (r × in) replicated, B (out/TP × r) holds the rows of this rank's
  weight shard. `h = A x` is the same on every rank; its gradient is all-reduced over the TP group (each rank's B
  shard contributes a part), as the base layer all-reduces its input gradient.
- row-parallel (`linear_proj`, `linear_fc2`): A (r × in/TP) holds the columns of this rank's weight shard, B (out × r)
  replicated; the partial products `A_i x_i` are all-reduced over the TP group before B, as the base layer reduces
  its partial outputs.

The adapted modules keep their class's behaviour and parameter names (the base weight stays `<linear>.weight`, so
checkpoints, HF conversion and loading are unchanged) and gain the adapter: each becomes an instance of a subclass
of its own class (`LoRAColumnParallelLinear`, ...), whose `sharded_state_dict` also shards the adapter for
`torch_dist` checkpoints (fc1's B split into gate and up rows, as the weight, so it re-shards across TP sizes).

`--target-modules` names HF modules; Megatron fuses some (`linear_qkv` = q_proj + k_proj + v_proj, `linear_fc1` =
gate_proj + up_proj) and a fused linear gets one adapter: A shared, B covering all its rows. Pushed to an engine it
is, exactly, one adapter per HF module with that A repeated and B's rows of the module. So a fused module is adapted
whole or not at all: naming only some of its HF modules is refused. Not built: the LM head (vocab-parallel), MoE
experts, multi-latent attention, TransformerEngine's layers (their fused layer norm hides the linear's input: pass
--transformer-impl local) and sequence parallelism.

A is initialised from the run's --seed and the module's global name, drawn whole and then split: the same adapter
at every TP / PP layout.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slime.utils.lora_adapter import ALL_LINEAR, adapters_switched_off, module_names

# Megatron linear -> the HF modules it computes (in HF order)
HF_MODULES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
_MEGATRON_OF = {hf: mg for mg, hfs in HF_MODULES.items() for hf in hfs}
_TARGET = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)$")


def megatron_targets(target_modules: str | None, exclude_modules: str | None = None) -> list[str]:
    """The Megatron linears (`linear_qkv`, ...) that `--target-modules` / `--exclude-modules` (HF names) select;
    ValueError naming the flag and the fix for a name Megatron has no linear for, or a fused linear named in part."""
    wanted, excluded = module_names(target_modules), module_names(exclude_modules)
    known = sorted(_MEGATRON_OF)
    for flag, names in (("--target-modules", [n for n in wanted if n != ALL_LINEAR]), ("--exclude-modules", excluded)):
        if "lm_head" in names:
            raise ValueError(f"{flag} {','.join(names)}: an adapter on the LM head is not built on the Megatron trainer "
                             "(its output layer is split over the vocabulary); leave lm_head out, or train with "
                             "--train-backend fsdp")
        unknown = [n for n in names if n not in _MEGATRON_OF]
        if unknown:
            raise ValueError(f"{flag} {','.join(names)}: the Megatron trainer adapts the decoder's linear layers, "
                             f"named as in HF: {known} (or all-linear); {unknown} is none of them")
    chosen = set(known) if ALL_LINEAR in wanted else set(wanted)
    chosen -= set(excluded)
    for linear, parts in HF_MODULES.items():
        picked = [p for p in parts if p in chosen]
        if picked and len(picked) < len(parts):
            raise ValueError(
                f"--target-modules {target_modules} (--exclude-modules {exclude_modules}) selects {picked} but not "
                f"{[p for p in parts if p not in picked]}: Megatron computes {', '.join(parts)} in one fused layer "
                f"({linear}) with one adapter (A shared, B split into their rows); select all of {','.join(parts)} "
                "or none of them (the fsdp trainer adapts them separately)")
    linears = [linear for linear, parts in HF_MODULES.items() if parts[0] in chosen]
    if not linears:
        raise ValueError(f"--target-modules {target_modules} minus --exclude-modules {exclude_modules} leaves no "
                         "linear layer to adapt; exclude fewer")
    return linears


def hf_target_names(linears: list[str]) -> list[str]:
    """The HF module names (PEFT's `target_modules`) of the adapted Megatron linears."""
    return [hf for linear in linears for hf in HF_MODULES[linear]]


class _ColumnLoRA:
    """Mixed in before a ColumnParallelLinear class: adds the adapter to the (ungathered) output shard."""

    lora_off = False  # set by `adapters_off` (on every rank alike: the row-parallel adapter's reduction is skipped too)

    def forward(self, input_, *args, **kwargs):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        output, bias = super().forward(input_, *args, **kwargs)
        if self.lora_off:
            return output, bias
        # h is replicated over the TP ranks; its gradient sums each rank's B-shard part
        h = copy_to_tensor_model_parallel_region(F.linear(input_, self.lora_A.weight), group=self.tp_group)
        return output + F.linear(h, self.lora_B.weight) * self.lora_scaling, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(_adapter_sharded(self, prefix, sharded_offsets, metadata, {"lora_B.weight": 0}))
        return out


class _RowLoRA:
    """Mixed in before a RowParallelLinear class: adds the adapter after the base layer's reduction."""

    lora_off = False

    def forward(self, input_, *args, **kwargs):
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        output, bias = super().forward(input_, *args, **kwargs)
        if self.lora_off:
            return output, bias
        h = reduce_from_tensor_model_parallel_region(F.linear(input_, self.lora_A.weight), group=self.tp_group)
        return output + F.linear(h, self.lora_B.weight) * self.lora_scaling, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(_adapter_sharded(self, prefix, sharded_offsets, metadata, {"lora_A.weight": 1}))
        return out


def _adapter_sharded(module, prefix: str, sharded_offsets, metadata, axis_map: dict) -> dict:
    """The adapter's ShardedTensors: the TP-split half along its axis, the other replicated; fc1's B in gate and up
    parts (as megatron-core's MLP shards fc1's weight)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = {k: v for k, v in module.state_dict(prefix="", keep_vars=True).items() if k.startswith("lora_")}
    groups = {}
    if metadata is not None and "dp_cp_group" in metadata:
        groups = {"tp_group": module.tp_group, "dp_cp_group": metadata["dp_cp_group"]}
    out = make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets, **groups)
    if module.lora_gated:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        key = f"{prefix}lora_B.weight"
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets,
                                                (metadata or {}).get("singleton_local_shards", False))
    return out


_CLASSES: dict = {}


def _lora_class(cls: type, mixin: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def initial_a(rank: int, fan_in: int, seed: int, module: str) -> torch.Tensor:
    """The whole A of `module` (r × fan_in, float64): Kaiming-uniform as PEFT initialises it (bound 1/sqrt(fan_in)),
    drawn from --seed and the module's global name, so that every layout starts from the same adapter."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(module.encode())) % (2**63))
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)


def _add_adapter(module: nn.Module, name: str, args: Any, gated: bool) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      set_tensor_model_parallel_attributes)

    rank, tp, tp_rank = args.lora_rank, ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    weight = module.weight
    kw = {"device": weight.device, "dtype": weight.dtype}
    if isinstance(module, ColumnParallelLinear):
        if module.gather_output or module.sequence_parallel:
            raise ValueError(f"{name}: LoRA on a column-parallel linear that gathers its output or runs sequence "
                             "parallel is not built; drop --sequence-parallel")
        a = initial_a(rank, weight.shape[1], args.seed, name)
        b_shape, mixin, split = (weight.shape[0], rank), _ColumnLoRA, ("lora_B", 0)
    elif isinstance(module, RowParallelLinear):
        if not module.input_is_parallel or module.sequence_parallel:
            raise ValueError(f"{name}: LoRA on a row-parallel linear whose input is not split or that runs sequence "
                             "parallel is not built; drop --sequence-parallel")
        a = torch.chunk(initial_a(rank, weight.shape[1] * tp, args.seed, name), tp, dim=1)[tp_rank]
        b_shape, mixin, split = (weight.shape[0], rank), _RowLoRA, ("lora_A", 1)
    else:
        raise ValueError(f"{name} is a {type(module).__name__}: LoRA on the Megatron trainer wraps megatron-core's "
                         "local ColumnParallelLinear / RowParallelLinear; pass --transformer-impl local")
    module.lora_A = nn.Linear(a.shape[1], rank, bias=False, **kw)
    module.lora_B = nn.Linear(rank, b_shape[0], bias=False, **kw)
    with torch.no_grad():
        module.lora_A.weight.copy_(a)
        module.lora_B.weight.zero_()
    set_tensor_model_parallel_attributes(getattr(module, split[0]).weight, True, split[1], 1)
    module.lora_scaling = args.lora_alpha / rank
    module.lora_gated = gated
    module.__class__ = _lora_class(type(module), mixin)


def adapters_off(chunks: list[nn.Module]):
    """Context: the model chunks compute their frozen base alone (the KL term's reference pass), adapters back on
    after."""
    return adapters_switched_off(m for chunk in chunks for m in chunk.modules()
                                 if isinstance(m, (_ColumnLoRA, _RowLoRA)))


def global_module_name(gpt: nn.Module, local: str) -> str:
    """A decoder module's name in the whole model (this pipeline stage's layer index offset applied)."""
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", local)
    if not m:
        return local
    return f"decoder.layers.{gpt.decoder.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"


def apply_lora(chunks: list[nn.Module], args: Any) -> list[str]:
    """Freeze every parameter of this rank's GPTModel chunks (before DDP wraps them) and add an adapter to each
    target linear; returns their global names."""
    linears = set(megatron_targets(args.target_modules, args.exclude_modules))
    names = []
    for gpt in chunks:
        gpt.requires_grad_(False)
        for local, module in list(gpt.named_modules()):
            m = _TARGET.match(local)
            if m is None or m.group(3) not in linears:
                continue
            name = global_module_name(gpt, local)
            _add_adapter(module, name, args, gated=m.group(3) == "linear_fc1" and gpt.config.gated_linear_unit)
            names.append(name)
    return names
