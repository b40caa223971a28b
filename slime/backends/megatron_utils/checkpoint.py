"""Megatron `torch_dist` checkpoints (megatron-core `dist_checkpointing`), in Megatron-LM's layout
(slime/utils/checkpoint_layout.py): each iteration folder holds the dist_checkpointing files ("model" (+
"optimizer")) and `slime_state.json` (rollout id, optimizer step, LR-scheduler state); `release/` holds weights
only (tools/convert_hf_to_torch_dist.py); the latest marker is written last.

Sharded tensors re-shard on load, so a checkpoint saved at one TP/PP/DP layout loads at another.
With LoRA the adapter is part of the model's sharded state (split as its layer is) and its optimizer state is the
whole optimizer state; the actor also writes it as a PEFT folder in the iteration's `adapter/`.
A "release" checkpoint is a starting point, not a resume: training starts at rollout 0 without optimizer
state. Simplifications: the RNG state is not saved (training uses no dropout).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime.backends.megatron_utils.model import chained, set_adam_kernel, torch_adams, unwrap
from slime.utils import checkpoint_layout as layout
from slime.utils.checkpoint_layout import LATEST_FILE, RELEASE, is_torch_dist_dir, iteration_dir
from slime.utils.lora_adapter import is_adapter_name

logger = logging.getLogger(__name__)

STATE_FILE = layout.MEGATRON_STATE_FILE
# The distributed optimizer's state in a canonical per-parameter form, gathered on data-parallel rank 0 at
# save: it reloads at any TP / PP / DP layout (the default of megatron-core 0.16 cannot be saved at all). Written into
# the checkpoint as megatron-core's content metadata, as Megatron-LM does, so a load asks for the format it was
# saved in (`_saved_metadata`).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass
class TorchDistCheckpoint:
    path: str
    iteration: int | None  # None for a release (weights-only) checkpoint
    state: dict


def find_checkpoint(root: str | None, flag: str = "--load") -> TorchDistCheckpoint | None:
    """The checkpoint a `--load` / `--ref-load` folder names, or None when it holds none yet.

    Accepts a save folder (with latest_checkpointed_iteration.txt) or one checkpoint folder itself."""
    if not root or not os.path.isdir(root):
        return None
    if is_torch_dist_dir(root):
        return TorchDistCheckpoint(root, None, _read_state(root))
    if not layout.has_checkpoint(root):
        return None
    latest = layout.latest_path(root)
    named = layout.read_latest(root, release_ok=True)
    iteration = None if named == RELEASE else named
    path = iteration_dir(root, iteration)
    if not is_torch_dist_dir(path):
        what = "does not exist" if not os.path.isdir(path) else "holds no torch_dist checkpoint (no metadata.json)"
        complete = complete_iterations(root)
        fix = (f"write {complete[-1]} (the newest complete one; found: {complete}) into {latest}, or " if complete
               else "")  # fmt: skip
        raise FileNotFoundError(f"{flag} {root}: {LATEST_FILE} names {named} but {path} {what} (a save was "
                                f"interrupted or the folder was copied in part); {fix}point {flag} at a complete "
                                "checkpoint. Nothing was loaded or written.")  # fmt: skip
    return TorchDistCheckpoint(path, iteration, _read_state(path))


def checkpoint_at(root: str, step: int, load_flag: str, step_flag: str) -> TorchDistCheckpoint:
    """Iteration `step` of the save folder `root` (--ref-ckpt-step of --ref-load, --opd-teacher-ckpt-step of
    --opd-teacher-load); a missing one fails naming the folder and the complete iterations there."""
    folder = iteration_dir(root, step)
    if not is_torch_dist_dir(folder):
        found = complete_iterations(root) if os.path.isdir(root) else []
        raise FileNotFoundError(f"{step_flag} {step}: {folder} holds no torch_dist checkpoint of {load_flag} {root} "
                                f"(complete iterations: {found}); give one of them")
    return TorchDistCheckpoint(folder, step, _read_state(folder))


def complete_iterations(root: str) -> list[int]:
    """Rollout ids of the iteration folders under `root` that hold a torch_dist checkpoint, ascending."""
    return [i for i, path in layout.iterations(root) if is_torch_dist_dir(path)]


def _read_state(path: str) -> dict:
    state_file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_file):
        return {}
    try:
        with open(state_file) as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{state_file} is not valid JSON ({e}): the save was interrupted; restore the file or "
                         f"point {LATEST_FILE} at an earlier iteration") from None


def _model_sharded_state_dict(model: list[torch.nn.Module]) -> dict:
    if len(model) == 1:
        return {"model": unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def save(root: str, rollout_id: int | None, model: list[torch.nn.Module], optimizer=None,
         state: dict | None = None) -> str:
    """Collective. Writes the model (and optimizer) shards, then the state file and the latest marker."""
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, rollout_id)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sharded = _model_sharded_state_dict(model)
    if optimizer is not None:
        _give_torch_adams_state(optimizer)  # a save before the first optimizer step
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded if len(model) > 1 else sharded["model"],
                                                            metadata=_OPTIMIZER_METADATA)
    dist_checkpointing.save(sharded, path, content_metadata=_OPTIMIZER_METADATA)
    if dist.get_rank() == 0:
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump(dict(state or {}, rollout_id=rollout_id), f, indent=2)
        layout.write_latest(root, rollout_id)  # last: a crash mid-save leaves the previous checkpoint the latest
        logger.info("saved torch_dist checkpoint %s", path)
    dist.barrier()
    return path


def load_model(ckpt: TorchDistCheckpoint, model: list[torch.nn.Module], adapters: bool = False) -> None:
    """Collective: this rank's shards of the model weights; LoRA adapters too when `adapters` (a checkpoint saved
    with LoRA), else a LoRA model keeps its initial adapter."""
    from megatron.core import dist_checkpointing

    sharded = _model_sharded_state_dict(model)
    if not adapters:
        sharded = {key: {n: t for n, t in sd.items() if not is_adapter_name(n)} for key, sd in sharded.items()}
    loaded = dist_checkpointing.load(sharded, ckpt.path)
    keys = ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]
    for key, chunk in zip(keys, model):
        unwrap(chunk).load_state_dict(loaded[key], strict=False)


def load_optimizer(ckpt: TorchDistCheckpoint, model: list[torch.nn.Module], optimizer) -> None:
    """Collective: the optimizer state (after the model weights and the optimizer are built). A torch Adam (no
    TransformerEngine) keeps its kernel (--adam-kernel), which torch's `load_state_dict` would take from the saving
    run; under the distributed optimizer it needs `_torch_adam_loads` too."""
    from megatron.core import dist_checkpointing

    _check_optimizer_layout(ckpt, optimizer)
    metadata = _saved_metadata(ckpt)
    fused = any(group["fused"] for adam in torch_adams(optimizer) for group in adam.param_groups)
    with _torch_adam_loads(optimizer):
        sharded = _model_sharded_state_dict(model)
        wanted = {"optimizer": optimizer.sharded_state_dict(sharded if len(model) > 1 else sharded["model"],
                                                            is_loading=True, metadata=metadata)}
        loaded = dist_checkpointing.load(wanted, ckpt.path)
        optimizer.load_state_dict(loaded["optimizer"])
    set_adam_kernel(optimizer, fused)


def _saved_metadata(ckpt: TorchDistCheckpoint) -> dict:
    """What the optimizer's state was saved with: megatron-core's content metadata, which Megatron-LM writes (slime's
    checkpoints: the distributed optimizer `dp_reshardable` unless `--dist-ckpt-optim-fully-reshardable`, and key
    options such as `chained_optim_avoid_prefix`) and this repo's saves since 2026-12-07; the fully reshardable
    format for this repo's earlier checkpoints, which hold none. megatron-core loads the state only when asked in
    the format it was saved in."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_content_metadata(ckpt.path) or _OPTIMIZER_METADATA


def _distributed(optimizer) -> list:
    """megatron-core's distributed optimizers in `optimizer` (itself, or the ones it chains)."""
    return [o for o in chained(optimizer) if hasattr(o, "model_param_group_index_map")]


def _check_optimizer_layout(ckpt: TorchDistCheckpoint, optimizer) -> None:
    """megatron-core saves the distributed optimizer's state (`optimizer.state.param.*` fully reshardable, as here;
    `optimizer.distributed.*` in its other formats) and the other's (`optimizer.state.fp32_param.*`, or the moments
    alone in fp32) under different keys, and cannot load one into the other; its own error is a missing key deep in
    torch's checkpoint planner. Named here, with the fix."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = [k for k in FileSystemReader(ckpt.path).read_metadata().state_dict_metadata if k.startswith("optimizer.")]
    if not keys:
        return
    saved = any(k.startswith(("optimizer.state.param.", "optimizer.distributed.")) for k in keys)
    running = bool(_distributed(optimizer))
    if saved != running:
        how = {True: "with the distributed optimizer", False: "without the distributed optimizer"}
        flag = "--use-distributed-optimizer" if saved else "--no-use-distributed-optimizer"
        raise ValueError(f"--load: the optimizer state in {ckpt.path} was saved {how[saved]}, and this run builds its "
                         f"optimizer {how[running]} (on by default since 2026-12-07, as in slime); megatron-core loads "
                         f"neither into the other. Pass {flag} to resume it, or --no-load-optim to resume the weights "
                         "with a fresh optimizer. The checkpoint is untouched.")


@contextlib.contextmanager
def _torch_adam_loads(optimizer):
    """What megatron-core's distributed optimizer (0.16 to 0.19) lacks to load the state of torch's Adam, which it
    steps without TransformerEngine: the state of a fresh optimizer (`_give_torch_adams_state`), and, as it copies
    the checkpoint's tensors onto every state tensor of a parameter, the step counter included, each parameter's
    count kept, which it has just set from the saved parameter groups: no format holds it per parameter (the fully
    reshardable one skips it: KeyError 'step'; the dp_reshardable one, Megatron-LM's, hands back the fresh
    optimizer's zero count as if it were loaded)."""
    distributed = _give_torch_adams_state(optimizer)
    for dist_opt in distributed:
        set_states = dist_opt._set_main_param_and_optimizer_states

        def keeping_step(model_param, tensors, dist_opt=dist_opt, set_states=set_states):
            group_index, group_order = dist_opt.model_param_group_index_map[model_param]
            main_param = dist_opt.optimizer.param_groups[group_index]["params"][group_order]
            step = dist_opt.optimizer.state[main_param].get("step")
            set_states(model_param, tensors if step is None else {**tensors, "step": step})

        dist_opt._set_main_param_and_optimizer_states = keeping_step  # this instance only, for this load
    try:
        yield
    finally:
        for dist_opt in distributed:
            del dist_opt._set_main_param_and_optimizer_states


def _give_torch_adams_state(optimizer) -> list:
    """megatron-core's distributed optimizers (0.16 to 0.19) that step a torch Adam (no TransformerEngine), each
    Adam given the zero state torch makes at its first step if it has none: their `state_dict()`, which a save and a
    load both call, reads the step count from the per-parameter state (`assert len(steps) == 1` otherwise). The
    next step is then a fresh Adam's first, as without it."""
    distributed = [o for o in _distributed(optimizer) if torch_adams(o)]
    for dist_opt in distributed:
        if not dist_opt.optimizer.state:
            _zero_adam_state(dist_opt.optimizer)
    return distributed


def _zero_adam_state(adam: torch.optim.Optimizer) -> None:
    """The state torch's Adam makes at its first step, zero, where it keeps it."""
    for group in adam.param_groups:
        for p in group["params"]:
            on_device = group["fused"] or group["capturable"]
            state = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p)
            adam.state[p] = state
