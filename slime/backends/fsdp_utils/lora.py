"""LoRA layers for the fsdp trainer: `LoRALinear` in place of the target `nn.Linear`s of a transformers model.

A wrapped layer computes `x W^T + b + (alpha / r) · (x A^T) B^T`. It keeps the original layer's `weight` and `bias`
as its own parameters (frozen), so the model's state dict keeps every HF name, and adds `lora_A.weight` (r × in,
Kaiming-uniform as PEFT initialises it) and `lora_B.weight` (out × r, zeros: at step 0 the model is exactly the
base model). These suffixes are PEFT's, so the adapter's tensors are a PEFT adapter's under the model's own module
names (slime.utils.lora_adapter holds that format: the names, adapter_config.json and the folder).

Assumed: dropout 0 (validation refuses more; every forward here runs without dropout), one adapter per model.
`all-linear` leaves the LM head (the model's output embeddings) out, as PEFT's does; naming it adapts it, unless it is
tied to the input embeddings (an engine merging the adapter would change the embeddings too: refused).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from slime.utils.backend_specs import engine_spec
from slime.utils.lora_adapter import (ADAPTER_DIR, ALL_LINEAR, PEFT_PREFIX, adapters_switched_off,
                                      is_adapter_name, module_names, write_adapter_folder)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank

    lora_off = False  # set by `adapters_off`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_off:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x)) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.rank}, alpha={self.alpha}"


def adapters_off(model: nn.Module):
    """Context: `model` computes its frozen base alone (the KL term's reference pass), adapters back on after."""
    return adapters_switched_off(m for m in model.modules() if isinstance(m, LoRALinear))


def target_names(model: nn.Module, target_modules: str, exclude_modules: str | None = None) -> list[str]:
    """Full names of the `nn.Linear` modules `--target-modules` / `--exclude-modules` select (by the last part of
    the name; `all-linear`: every one but the LM head, which is adapted only when named and untied). A given name
    that matches no linear layer is an error naming the ones there are."""
    head = model.get_output_embeddings()
    wanted, excluded = module_names(target_modules), module_names(exclude_modules)
    # all-linear leaves the LM head out (as PEFT does); naming it adapts it
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and (m is not head or name.rsplit(".", 1)[-1] in wanted)}
    short = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    for flag, names in (("--target-modules", [n for n in wanted if n != ALL_LINEAR]), ("--exclude-modules", excluded)):
        unknown = [n for n in names if n not in short]
        if unknown:
            raise ValueError(f"{flag} {','.join(names)}: no linear layer named {unknown} in this model; its linear "
                             f"layers are {short}")
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    named_head = [name for name, m in linears.items() if m is head]
    if named_head and tied:
        raise ValueError(f"--target-modules {target_modules}: {named_head[0]} shares its weight with the input "
                         "embeddings (tie_word_embeddings); an adapter merged into it would change them too; leave it "
                         "out")
    chosen = [name for name in linears
              if (ALL_LINEAR in wanted or name.rsplit(".", 1)[-1] in wanted) and name.rsplit(".", 1)[-1] not in excluded]
    if not chosen:
        raise ValueError(f"--target-modules {target_modules} minus --exclude-modules {exclude_modules} leaves no "
                         "linear layer to adapt; exclude fewer")
    return chosen


def peft_target_modules(model: nn.Module, names: list[str]) -> list[str]:
    """PEFT's `target_modules` for the adapted modules `names`: the last part of each name, which PEFT matches
    against the end of every module name, except where that part also ends a module left out (a vision-language
    model: the merger's `mlp.0` / `mlp.2` against the decoder layers `layers.0` / `layers.2`, the tower's `attn.proj`
    against its patch embedding's `proj`): those adapted modules are listed by their full name, which PEFT matches
    exactly. Call before `apply_lora` (its LoRA layers add modules of their own)."""
    chosen = set(names)
    others = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name and name not in chosen}
    short = {name.rsplit(".", 1)[-1] for name in names}
    return sorted(s for s in short if s not in others) + sorted(n for n in names if n.rsplit(".", 1)[-1] in others)


def outside_decoder(model: nn.Module, names: list[str]) -> list[str]:
    """The adapted modules that are not in the model's language model (`get_decoder()`): a vision-language model's
    vision tower and merger; none for a text model."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        return []
    inside = {name for name, m in model.named_modules() if m is decoder}
    return [n for n in names if not any(n.startswith(prefix + ".") for prefix in inside)]


def check_engine_adapts(names: list[str], tower: list[str], args) -> None:
    """Adapters on a vision tower (`tower`: the adapted modules outside the language model) are served only by the
    hf engine, which merges any linear layer's adapter; SGLang applies LoRA to the language model alone (its
    Qwen-VL models skip the tower), so it would serve another policy than the trainer's. ValueError naming the fix."""
    engine = engine_spec(args).name
    if not tower or engine == "hf":
        return
    tower_short = {n.rsplit(".", 1)[-1] for n in tower}
    decoder_only = sorted({n.rsplit(".", 1)[-1] for n in names if n not in tower} - tower_short)
    raise ValueError(
        f"--lora-rank {args.lora_rank} --target-modules {args.target_modules} (--exclude-modules "
        f"{args.exclude_modules}) puts adapters on {len(tower)} modules of the vision tower (e.g. {tower[:3]}) and "
        f"--rollout-backend {engine} does not apply them (SGLang's LoRA covers the language model "
        "only); the engine would serve another policy than the trainer's. Pass --target-modules "
        f"{','.join(decoder_only) or '<decoder modules>'} (names this model's tower does not use), "
        "--train-backend megatron (adapters on the decoder only) or --rollout-backend hf")


def apply_lora(model: nn.Module, rank: int, alpha: float, target_modules: str,
               exclude_modules: str | None = None) -> list[str]:
    """Freeze every parameter of `model` and put a `LoRALinear` in place of each target layer (before FSDP wraps
    the model). Returns the adapted modules' names."""
    model.requires_grad_(False)
    names = target_names(model, target_modules, exclude_modules)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha))
    return names


def load_adapter_folder(model: nn.Module, path: str) -> int:
    """Copy a PEFT adapter folder's tensors (adapter_model.safetensors) into the model's LoRA layers, before FSDP
    wraps it; every adapter tensor of the model must be there, with its shape. Returns the tensors loaded."""
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--lora-adapter-path {path}: no adapter_model.safetensors there (a PEFT adapter "
                                "folder holds it and adapter_config.json)")
    loaded = {name.removeprefix(PEFT_PREFIX): t for name, t in load_file(file).items()}
    params = {n: p for n, p in model.named_parameters() if is_adapter_name(n)}
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ValueError(f"--lora-adapter-path {path}: {len(missing)} adapter tensor(s) of this run are not in the "
                         f"folder, e.g. {missing[:3]}; its --target-modules must match the adapter's")
    bad = [f"{n}: {tuple(loaded[n].shape)} vs {tuple(p.shape)}" for n, p in params.items()
           if tuple(loaded[n].shape) != tuple(p.shape)]
    if bad:
        raise ValueError(f"--lora-adapter-path {path}: shapes differ from --lora-rank {bad[:3]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(loaded[n])
    return len(params)


def lora_folder_writer(config: dict, write_hf_folder: Callable) -> Callable:
    """`save_checkpoint`'s `write_folder` for a LoRA model: the base model's HF folder (loadable as it was) and the
    PEFT adapter in its `adapter/` subfolder."""

    def write(model, state, path, hf_checkpoint):
        write_hf_folder(model, {n: t for n, t in state.items() if not is_adapter_name(n)}, path, hf_checkpoint)
        write_adapter_folder(state, config, os.path.join(path, ADAPTER_DIR))

    return write


def export_merged(iteration_folder: str, weights_file: str, adapter_out: str) -> None:
    """--save-hf with LoRA: the saved iteration's base weights with its adapter merged in (`W + (alpha / r) B A`,
    what the engines serve) written to `weights_file`, and the PEFT adapter folder copied to `adapter_out`."""
    adapter_dir = os.path.join(iteration_folder, ADAPTER_DIR)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    scaling = config["lora_alpha"] / config["r"]
    state = load_file(os.path.join(iteration_folder, "model.safetensors"))
    adapter = {n.removeprefix(PEFT_PREFIX): t for n, t in load_file(os.path.join(adapter_dir,
                                                                                  "adapter_model.safetensors")).items()}
    for name, a in adapter.items():
        if name.endswith(".lora_A.weight"):
            module = name[: -len(".lora_A.weight")]
            b = adapter[module + ".lora_B.weight"]
            state[module + ".weight"] = state[module + ".weight"] + scaling * (b @ a)
    save_file(state, weights_file, metadata={"format": "pt"})
    os.makedirs(adapter_out, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(os.path.join(adapter_dir, name), os.path.join(adapter_out, name))
