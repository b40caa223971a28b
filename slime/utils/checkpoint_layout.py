"""The folder layout of a save folder (`--save` / `--load`), shared by both trainers, the rollout's data source, the
resume checks of validation and the `--save-hf` export. Only names and plain file operations live here: what an
iteration folder holds is each backend's format (torch_dist shards or an HF folder).

    <save>/latest_checkpointed_iteration.txt          the last complete rollout id (or "release"), written last
    <save>/iter_0000007/                              one iteration: the backend's files, plus
        slime_state.json  (megatron)                  rollout id, optimizer step, LR-scheduler state
        trainer_state.json, optimizer/  (fsdp)        rollout id, step count, world size; the DCP optimizer state
    <save>/release/                                   weights only (tools/convert_hf_to_torch_dist.py)
    <save>/critic/                                    the PPO critic's save folder, same layout (fsdp)
    <save>/rollout/data_source_state_7.json           the data source after rollout 7
    --save-hf /out/hf_{rollout_id}                    the HF export of each checkpoint: /out/hf_7

The latest marker is slime's (Megatron-LM's) name and is written last and atomically, so a crash mid-save leaves
the previous checkpoint as the latest.
"""

from __future__ import annotations

import os

LATEST_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
ITERATION_PREFIX = "iter_"
MEGATRON_STATE_FILE = "slime_state.json"
FSDP_STATE_FILE = "trainer_state.json"
FSDP_OPTIMIZER_DIR = "optimizer"
CRITIC_DIR = "critic"
ROLLOUT_DIR = "rollout"
TORCH_DIST_MARKER = "metadata.json"  # written by megatron-core's dist_checkpointing
HF_CONFIG = "config.json"


def iteration_dir(root: str, rollout_id: int | None) -> str:
    """The folder of iteration `rollout_id` (None: the weights-only "release" folder)."""
    return os.path.join(root, RELEASE if rollout_id is None else f"{ITERATION_PREFIX}{rollout_id:07d}")


def iteration_of(name: str) -> int | None:
    """The rollout id of an iteration folder's name (`iter_0000007` -> 7), or None for any other name."""
    digits = name[len(ITERATION_PREFIX):]
    return int(digits) if name.startswith(ITERATION_PREFIX) and digits.isdigit() else None


def iterations(root: str) -> list[tuple[int, str]]:
    """(rollout id, folder) of every iteration folder under `root`, ascending by id."""
    found = [(iteration_of(name), os.path.join(root, name)) for name in os.listdir(root)]
    return sorted((i, path) for i, path in found if i is not None)


def latest_path(root: str) -> str:
    return os.path.join(root, LATEST_FILE)


def has_checkpoint(root: str | None) -> bool:
    """`root` holds a latest marker (a save folder someone wrote into; its iteration may still be incomplete)."""
    return bool(root) and os.path.isfile(latest_path(root))


def read_latest(root: str, release_ok: bool = False) -> int | str:
    """The iteration the latest marker of `root` names: a rollout id, or RELEASE when `release_ok`. The caller
    checks `has_checkpoint` first; a marker that holds anything else fails naming the file."""
    latest = latest_path(root)
    with open(latest) as f:
        text = f.read().strip()
    if release_ok and text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        expected = "a rollout id or 'release'" if release_ok else "a rollout id"
        raise ValueError(f"{latest}:1: expected {expected}, found {text!r}; fix or delete the file") from None


def write_latest(root: str, rollout_id: int | None) -> None:
    """Name `rollout_id` (None: the release folder) the latest, atomically (a temporary file renamed over it)."""
    tmp = latest_path(root) + ".tmp"
    with open(tmp, "w") as f:
        f.write(RELEASE if rollout_id is None else str(rollout_id))
    os.replace(tmp, latest_path(root))


def is_torch_dist_dir(path: str) -> bool:
    """`path` holds a torch_dist checkpoint (its metadata file is there)."""
    return os.path.isfile(os.path.join(path, TORCH_DIST_MARKER))


def is_hf_folder(path: str | None) -> bool:
    """`path` is an HF model folder (it has a config.json)."""
    return bool(path) and os.path.isfile(os.path.join(path, HF_CONFIG))


def critic_dir(root: str) -> str:
    """The PPO critic's save folder inside the actor's `root`."""
    return os.path.join(root, CRITIC_DIR)


def save_folders(root: str, with_critic: bool) -> list[str]:
    """The save folders a run writes under `root`: the actor's, and the critic's when the backend has one."""
    return [root] + ([critic_dir(root)] if with_critic else [])


def data_source_state_path(root: str, rollout_id: int) -> str:
    """The data source's state after `rollout_id`, under a save folder."""
    return os.path.join(root, ROLLOUT_DIR, f"data_source_state_{rollout_id}.json")


def hf_export_dir(template: str, rollout_id: int) -> str:
    """The `--save-hf` folder of one checkpoint: the template formatted with the rollout id."""
    return template.format(rollout_id=rollout_id)
