"""--save-hf: an HF model folder written next to each checkpoint, for both training backends.

The folder is `--save-hf` formatted with the rollout id (`/out/hf_{rollout_id}` -> `/out/hf_7`); each backend
writes its weights there as `model.safetensors` (one file: the sizes trained here fit one) and this module
supplies the rest: the target path, clearing weight files a previous save left there, and every non-weight
file of `--hf-checkpoint` (config.json, tokenizer and generation files), so the folder loads with
`from_pretrained` like the model it started from. Simplified: no sharded safetensors index.
"""

from __future__ import annotations

import argparse
import os
import shutil

from slime.utils.checkpoint_layout import hf_export_dir

WEIGHTS_FILE = "model.safetensors"
_WEIGHT_NAMES = {"model.safetensors.index.json", "pytorch_model.bin.index.json", "tf_model.h5",
                 "flax_model.msgpack"}  # fmt: skip
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack")


def hf_save_path(args: argparse.Namespace, rollout_id: int) -> str | None:
    """The folder --save-hf names for this rollout's checkpoint, or None without the flag."""
    return None if args.save_hf is None else hf_export_dir(args.save_hf, rollout_id)


def _is_weight_file(name: str) -> bool:
    return name in _WEIGHT_NAMES or name.endswith(_WEIGHT_SUFFIXES)


def prepare_hf_folder(path: str, hf_checkpoint: str) -> str:
    """Make `path`, drop its old weight files, copy --hf-checkpoint's other files; returns the weights file
    to write."""
    if os.path.realpath(path) == os.path.realpath(hf_checkpoint):
        raise ValueError(f"--save-hf {path}: that is --hf-checkpoint itself; give another folder")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if _is_weight_file(name) and os.path.isfile(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    for name in os.listdir(hf_checkpoint):
        src = os.path.join(hf_checkpoint, name)
        if os.path.isfile(src) and not _is_weight_file(name):
            shutil.copyfile(src, os.path.join(path, name))
    return os.path.join(path, WEIGHTS_FILE)
