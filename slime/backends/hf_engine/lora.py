"""LoRA adapters on the `hf` engine: `/load_lora_adapter_from_tensors`, `/load_lora_adapter`, `/unload_lora_adapter`.

The engine serves one adapter at a time by merging it into its weights: it keeps a copy of the base weight of each
adapted linear layer (taken when the first adapter touches it) and sets `W = W_base + (lora_alpha / r) · B A`.
Loading again (the trainer's next push) recomputes from the kept base copies, so pushes never accumulate; unloading
restores the base. The forward is then the plain model's, so decoding equals a model with the merged weights.
An engine whose weights are released with `base_backup` (a LoRA engine colocated with its trainer: release.py)
keeps no device copy of the base: the one host copy of the frozen base serves both the resume and the merges, and
after a resume, which brings back the base, the loaded adapter is merged again from its A and B (kept on the host,
as pushed), so a resumed engine serves what it served before the release.

As SGLang 0.5.16: answers are `{success, error_message, loaded_adapters: {name: lora_path}}` (`"__tensor__"` for an
adapter loaded from tensors), 400 when refused; `/load_lora_adapter` refuses a name already loaded; a /generate
request naming in `lora_path` an adapter that is not loaded answers 400 (`check_lora_path`).
Simplified: one adapter at a time (loading another name replaces the first), and while one is loaded every request
is served with it, also one without `lora_path` (SGLang serves that one with the base model).
`/load_lora_adapter_from_tensors` takes only `load_format: "flattened_bucket"` (slime.weight_sync.tensor_payload)
and, unlike SGLang, replaces an adapter loaded under the same name: the trainer's pushes reuse one name.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from safetensors.torch import load_file
from starlette.concurrency import run_in_threadpool

from slime.backends.hf_engine.release import WeightMemory
from slime.utils.lora_adapter import module_of
from slime.weight_sync.tensor_payload import deserialize_bucket


TENSOR_SOURCE = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors


class MergedAdapter:
    """The adapter merged into `model`'s linear weights, and the base copies that undo it (device copies, or with
    `weights` in base_backup mode its host copy of the whole base)."""

    def __init__(self, model: torch.nn.Module, weights: WeightMemory | None = None,
                 model_name: Callable[[str], str] | None = None):
        self.model = model
        # a parameter name as a checkpoint spells it -> the model's (checkpoint_names.py); the Megatron trainer names
        # a Qwen2.5-VL adapter as the checkpoint does (model.layers.*), transformers keeps it in model.language_model
        self.model_name = model_name or (lambda name: name)
        self.weights = weights if weights is not None and weights.mode == "base_backup" else None
        self.base: dict[str, torch.Tensor] = {}  # module name -> its base weight (a device copy; none with weights)
        self.merged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module -> the merged (A, B), on the host
        self.scale = 0.0
        self.name: str | None = None
        self.info: dict = {}

    def pairs(self, named: list[tuple[str, torch.Tensor]], config: dict, source: str) -> dict[str, tuple]:
        """{module: (A, B)} checked against the model and the config's rank; a bad name or shape raises ValueError
        naming it (nothing is applied)."""
        rank = int(config.get("r") or 0)
        if rank <= 0 or "lora_alpha" not in config:
            raise ValueError(f"{source}: config_dict needs PEFT's 'r' (> 0) and 'lora_alpha', got {config}")
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            module, half = module_of(name)
            module = self.model_name(module + ".weight").removesuffix(".weight")
            halves.setdefault(module, {})[half] = tensor
        out = {}
        for module, h in halves.items():
            try:
                layer = self.model.get_submodule(module)
            except AttributeError:
                raise ValueError(f"{source}: {module} is no module of this model (adapter tensors are named "
                                 "<module>.lora_A.weight / <module>.lora_B.weight)") from None
            if not isinstance(layer, torch.nn.Linear):
                raise ValueError(f"{source}: {module} is a {type(layer).__name__}, not a linear layer")
            if set(h) != {"A", "B"}:
                raise ValueError(f"{source}: {module} has only lora_{''.join(h)}; both lora_A and lora_B are needed")
            a, b = h["A"], h["B"]
            want_a, want_b = (rank, layer.in_features), (layer.out_features, rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(f"{source}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected "
                                 f"{want_a} / {want_b} for r={rank}")
            out[module] = (a, b)
        if not out:
            raise ValueError(f"{source}: no adapter tensors")
        return out

    @torch.no_grad()
    def load(self, lora_name: str, named: list[tuple[str, torch.Tensor]], config: dict, source: str) -> dict:
        pairs = self.pairs(named, config, source)
        if self.weights is not None:
            self.weights.snapshot()  # the first adapter (or the first after a full load): the weights are the base
        self.restore()
        self.scale = float(config["lora_alpha"]) / int(config["r"])
        self.merged = {m: (a.detach().to("cpu", copy=True), b.detach().to("cpu", copy=True))
                       for m, (a, b) in pairs.items()}
        self._merge()
        self.name = lora_name
        self.info = {"source": TENSOR_SOURCE, "r": int(config["r"]), "lora_alpha": config["lora_alpha"], "modules": len(pairs),
                     "tensors": 2 * len(pairs), "bytes": sum(t.numel() * t.element_size() for _, t in named)}
        return self.info

    @torch.no_grad()
    def _merge(self) -> None:
        """W = W_base + scale · B A for every module in `merged`, from the base copies (the weights hold the base
        with a host copy)."""
        for module, (a, b) in self.merged.items():
            weight = self.model.get_submodule(module).weight
            if self.weights is None and module not in self.base:
                self.base[module] = weight.detach().clone()
            base = weight if self.weights is not None else self.base[module]
            delta = (b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)) * self.scale
            weight.copy_((base.to(torch.float32) + delta).to(weight.dtype))

    def reapply(self) -> None:
        """After a base_backup resume (the weights are the base again): merge the loaded adapter again."""
        if self.name is not None and self.weights is not None:
            self._merge()

    @torch.no_grad()
    def restore(self) -> None:
        """The base weights back (a no-op without an adapter)."""
        if self.name is None:
            return
        if self.weights is not None:
            self.weights.restore_params([self.model.get_submodule(m).weight for m in self.merged])
        else:
            for module, base in self.base.items():
                self.model.get_submodule(module).weight.copy_(base)
        self.merged, self.name, self.info = {}, None, {}

    def summary(self) -> dict | None:
        """/server_info's `lora_adapter`: the merged adapter's name, rank, alpha, modules, tensors and bytes."""
        return {"name": self.name, **self.info} if self.name else None

    def check_lora_path(self, lora_path) -> None:
        """A /generate body's `lora_path` (one name, or one per prompt, None for the base) must name the loaded
        adapter; otherwise ValueError with SGLang's message."""
        for name in lora_path if isinstance(lora_path, list) else [lora_path]:
            if name is not None and name != self.name:
                loaded = [self.name] if self.name else []
                raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {loaded}.")

    def forget_base(self) -> None:
        """Full weights were loaded: they are the new base (any merged adapter is gone with the old weights)."""
        self.base.clear()
        self.merged, self.name, self.info = {}, None, {}
        if self.weights is not None:
            self.weights.changed()


def read_adapter_folder(path: str) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """A PEFT adapter folder's tensors and adapter_config.json."""
    config_file, weights = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    for file in (config_file, weights):
        if not os.path.isfile(file):
            raise ValueError(f"lora_path {path}: no {os.path.basename(file)} (a PEFT adapter folder holds "
                             "adapter_config.json and adapter_model.safetensors)")
    with open(config_file) as f:
        config = json.load(f)
    return list(load_file(weights).items()), config


def add_lora_routes(app: FastAPI, state, check_weight_dir: Callable[[str, list[str]], None]) -> None:
    """SGLang's three adapter endpoints on `app`; `state` is the server's EngineState (its lock, scheduler, adapter).
    Answers are SGLang's `{success, error_message, loaded_adapters}`; a refused request changes nothing (400)."""

    def apply(change: Callable[[], dict | None], weight_version) -> dict:
        with state.memory_lock:
            if state.weights.freed:
                raise ValueError("the weights are released (their memory is freed); POST /resume_memory_occupation "
                                 "before loading an adapter")
            with state.scheduler.exclusive():
                change()
        if weight_version is not None:
            state.weight_version = str(weight_version)
        return {"success": True, "error_message": "", "loaded_adapters": loaded(),
                "weight_version": state.weight_version}

    def loaded() -> dict:
        adapter = state.adapter
        return {adapter.name: adapter.info.get("source", TENSOR_SOURCE)} if adapter.name else {}

    def refused(message: str) -> JSONResponse:
        return JSONResponse({"success": False, "error_message": message, "loaded_adapters": loaded(),
                             "error": {"message": message}}, status_code=400)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(http: HTTPRequest):
        body = await http.json()
        fmt = body.get("load_format") or "flattened_bucket"
        if fmt != "flattened_bucket":
            return refused(f"load_format {fmt!r} is not supported by the hf engine; use 'flattened_bucket' "
                           "(slime.weight_sync.tensor_payload.serialize_bucket(flatten_bucket(named)))")
        name, config, payload = body.get("lora_name"), body.get("config_dict"), body.get("serialized_tensors")
        if not name or not isinstance(config, dict) or not payload:
            return refused("load_lora_adapter_from_tensors needs lora_name, config_dict (PEFT's adapter_config) and "
                           "serialized_tensors")
        source = "load_lora_adapter_from_tensors"
        try:
            named = await run_in_threadpool(lambda: deserialize_bucket(payload).unflatten())
            return await run_in_threadpool(apply, lambda: state.adapter.load(name, named, config, source),
                                           body.get("weight_version"))
        except (ValueError, TypeError, pickle.UnpicklingError) as e:
            return refused(str(e))

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(http: HTTPRequest):
        body = await http.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return refused("load_lora_adapter needs lora_name and lora_path (a PEFT adapter folder)")
        if name == state.adapter.name:
            return refused(f"Failed to load LoRA adapter {name} because it is already loaded; unload it first")
        try:
            check_weight_dir(path, state.weight_dirs)
            named, config = await run_in_threadpool(read_adapter_folder, path)
            out = await run_in_threadpool(apply, lambda: state.adapter.load(name, named, config, f"lora_path {path}"),
                                          body.get("weight_version"))
        except (ValueError, PermissionError) as e:
            return refused(str(e))
        state.adapter.info["source"] = path
        return {**out, "loaded_adapters": loaded()}

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(http: HTTPRequest):
        body = await http.json()
        name = body.get("lora_name")
        if not name or name != state.adapter.name:
            return refused(f"unload_lora_adapter: no adapter named {name!r} is loaded (loaded: {loaded()})")
        try:
            return await run_in_threadpool(apply, state.adapter.restore, None)
        except ValueError as e:
            return refused(str(e))
