"""Checkpoints of the fsdp backend.

Layout (slime's, slime/utils/checkpoint_layout.py, with HF weights instead of Megatron's torch_dist): each
iteration folder is an HF folder (`from_pretrained`: config.json, model.safetensors under the names and layout of
the checkpoint the model was loaded from (checkpoint_format.py), tokenizer files) with
`optimizer/` (torch.distributed.checkpoint of the AdamW state, sharded) and `trainer_state.json` (rollout id,
optimizer step count, world size); the latest marker is written last.

Loading builds the model from the iteration's HF folder (so `--load` weights replace `--hf-checkpoint`)
and restores the optimizer through DCP, which re-shards when the number of ranks changes.

Simplifications: the weights are written as a single safetensors file by rank 0 after a full-state-dict
gather (fine up to a few billion parameters); RNG state is not saved (training uses no dropout or
sampling; --no-load-rng has nothing to skip).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime.backends.fsdp_utils.checkpoint_format import checkpoint_state
from slime.backends.training.optimizer_state import set_adam_kernel
from slime.utils import checkpoint_layout as layout
from slime.utils.checkpoint_layout import LATEST_FILE, is_hf_folder, iteration_dir

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = layout.FSDP_STATE_FILE
OPTIMIZER_DIR = layout.FSDP_OPTIMIZER_DIR
# Files copied from --hf-checkpoint so that each iteration folder is a complete HF model folder.
_HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass
class Checkpoint:
    iteration: int
    path: str
    trainer_state: dict


def _missing_parts(path: str) -> list[str]:
    """What an iteration folder lacks to be loadable: the folder itself, config.json, the weights."""
    if not os.path.isdir(path):
        return ["the folder itself"]
    missing = [] if is_hf_folder(path) else ["config.json"]
    if not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path)):
        missing.append("the weights (*.safetensors)")
    return missing


def complete_iterations(load_dir: str) -> list[int]:
    """Rollout ids of the loadable iteration folders under `load_dir`, ascending."""
    return [i for i, path in layout.iterations(load_dir) if not _missing_parts(path)]


def _incomplete(load_dir: str, latest: str, iteration: int, path: str, missing: list[str]) -> FileNotFoundError:
    complete = complete_iterations(load_dir)
    fix = (f"write {complete[-1]} (the newest complete one; found: {complete}) into {latest}, or " if complete
           else "no complete iteration folder is there: ")  # fmt: skip
    return FileNotFoundError(
        f"--load {load_dir}: {LATEST_FILE} names iteration {iteration} but {path} is incomplete (missing: "
        f"{', '.join(missing)}; a save was interrupted or the folder was copied in part); {fix}point --load at a "
        "complete checkpoint folder (or at an empty one to start fresh). Nothing was loaded or written."
    )


def find_checkpoint(load_dir: str | None) -> Checkpoint | None:
    """The checkpoint `--load` points at, or None when the folder holds none (a fresh run)."""
    if not layout.has_checkpoint(load_dir):
        return None
    latest = layout.latest_path(load_dir)
    iteration = layout.read_latest(load_dir)
    path = iteration_dir(load_dir, iteration)
    missing = _missing_parts(path)
    if missing:
        raise _incomplete(load_dir, latest, iteration, path, missing)
    state = {}
    state_file = os.path.join(path, TRAINER_STATE_FILE)
    if os.path.isfile(state_file):
        try:
            with open(state_file) as f:
                state = json.load(f)
        except ValueError as e:
            raise ValueError(f"--load {load_dir}: {state_file} is not valid JSON ({e}); the save of iteration "
                             f"{iteration} was interrupted: restore the file or point {latest} at an earlier "
                             "iteration") from None  # fmt: skip
    return Checkpoint(iteration, path, state)


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    save_dir: str,
    rollout_id: int,
    hf_checkpoint: str | None,
    trainer_state: dict,
    write_folder=None,
) -> str:
    """Collective: every rank must call it. Returns the iteration folder. `write_folder(model, full_state,
    path, hf_checkpoint)` writes the weights on rank 0 (default: an HF causal-LM folder)."""
    write_folder = write_folder or write_hf_folder
    rank = dist.get_rank()
    path = iteration_dir(save_dir, rollout_id)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()

    import torch.distributed.checkpoint as dcp  # here, not at the top: validation reads folders (find_checkpoint)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        write_folder(model, full, path, hf_checkpoint)
    del full

    if optimizer is not None:
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=os.path.join(path, OPTIMIZER_DIR))
    if rank == 0:
        state = dict(trainer_state, rollout_id=rollout_id, world_size=dist.get_world_size())
        with open(os.path.join(path, TRAINER_STATE_FILE), "w") as f:
            json.dump(state, f, indent=2)
    dist.barrier()
    if rank == 0:
        layout.write_latest(save_dir, rollout_id)  # last: a crash mid-save leaves the previous checkpoint the latest
        logger.info("saved checkpoint %s", path)
    dist.barrier()
    return path


def write_hf_folder(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str, hf_checkpoint: str | None,
                     config=None):
    from safetensors.torch import save_file

    config = config if config is not None else model.config
    tied = bool(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                        "tie_word_embeddings", False))
    if tied and "lm_head.weight" in state:
        # from_pretrained re-ties it; safetensors refuses two names for one storage.
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = checkpoint_state(model, state)  # the names and layout of the folder it was loaded from
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(path)
    if hf_checkpoint and os.path.isdir(hf_checkpoint):
        for name in _HF_SIDE_FILES:
            src = os.path.join(hf_checkpoint, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(path, name))


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Materialise AdamW's per-parameter state (step, moments) so a DCP load has tensors to fill.

    A step with zero gradients and lr 0 leaves the parameters unchanged (decoupled weight decay is
    scaled by lr too)."""
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_path: str) -> bool:
    """Collective. Restores the optimizer saved under `checkpoint_path`; False when none was saved."""
    folder = os.path.join(checkpoint_path, OPTIMIZER_DIR)
    if not os.path.isdir(folder):
        logger.warning("%s has no optimizer state (saved with --no-save-optim?); starting a fresh optimizer",
                       checkpoint_path)
        return False
    fused = bool(optimizer.param_groups[0].get("fused"))  # the load takes the saving run's kernel
    init_optimizer_state(optimizer)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=folder)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    set_adam_kernel([optimizer], fused)
    return True
