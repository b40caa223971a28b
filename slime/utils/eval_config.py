"""Eval datasets with per-dataset overrides: `--eval-config` YAML, or `--eval-prompt-data name path ...`.

    eval:                          # the top-level `eval:` key is optional
      defaults:                    # optional: any dataset key, for every dataset
        max_response_len: 1024
      datasets:
        - name: aime
          path: /root/aime-2024/aime-2024.jsonl
          rm_type: deepscaler
          n_samples_per_eval_prompt: 16
          temperature: 0.6
          top_p: 0.95
          stop: ["</answer>"]

Dataset keys: name, path (required); rm_type, input_key, label_key, metadata_key, tool_key,
n_samples_per_eval_prompt, temperature, top_p, top_k, max_response_len, stop. A key a dataset leaves unset
falls back to the `--eval-*` flag, then to the rollout's. An unknown key, a missing name/path, a file that
does not exist or an unknown rm_type is an error naming the YAML file, the dataset and the key.
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

from slime.utils.data import parse_prompt_path

# dataset key -> (type check, the args attribute it overrides)
_OVERRIDES: dict[str, tuple[tuple[type, ...], str]] = {
    "input_key": ((str,), "eval_input_key"),
    "label_key": ((str,), "eval_label_key"),
    "metadata_key": ((str,), "metadata_key"),
    "tool_key": ((str,), "tool_key"),
    "n_samples_per_eval_prompt": ((int,), "n_samples_per_eval_prompt"),
    "temperature": ((int, float), "eval_temperature"),
    "top_p": ((int, float), "eval_top_p"),
    "top_k": ((int,), "eval_top_k"),
    "max_response_len": ((int,), "eval_max_response_len"),
    "stop": ((str, list), "rollout_stop"),
}
DATASET_KEYS = ("name", "path", "rm_type", *_OVERRIDES)


class EvalConfigError(ValueError):
    pass


def _check_dataset(where: str, ds: Any, base_dir: str) -> dict:
    if not isinstance(ds, dict):
        raise EvalConfigError(f"{where}: expected a mapping with name and path, got {type(ds).__name__}")
    unknown = sorted(set(ds) - set(DATASET_KEYS))
    if unknown:
        raise EvalConfigError(f"{where}: unknown key(s) {unknown}; known: {list(DATASET_KEYS)}")
    for key in ("name", "path"):
        if not isinstance(ds.get(key), str) or not ds[key]:
            raise EvalConfigError(f"{where}: `{key}` is required (a string)")
    for key, (types, _) in _OVERRIDES.items():
        value = ds.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise EvalConfigError(f"{where}: `{key}: {value!r}` should be {' or '.join(t.__name__ for t in types)}")
    if ds.get("n_samples_per_eval_prompt") is not None and ds["n_samples_per_eval_prompt"] < 1:
        raise EvalConfigError(f"{where}: `n_samples_per_eval_prompt` must be >= 1")
    if ds.get("rm_type") is not None and not isinstance(ds["rm_type"], str):
        raise EvalConfigError(f"{where}: `rm_type: {ds['rm_type']!r}` should be a str")
    out = dict(ds)
    if not os.path.isabs(out["path"]):
        out["path"] = os.path.join(base_dir, out["path"])
    try:
        file, _ = parse_prompt_path(out["path"], f"{where}: path")
    except ValueError as e:
        raise EvalConfigError(str(e)) from None
    if not os.path.isfile(file):
        raise EvalConfigError(f"{where}: path {ds['path']!r}: no such file")
    return out


def dataset_where(path: str, i: int, name: str) -> str:
    return f"--eval-config {path}: datasets[{i}] ({name})"


def load_eval_config(path: str) -> list[dict]:
    """The datasets of an `--eval-config` file, defaults merged in, paths relative to the file. Their rm_type
    names are checked by the caller (the reward functions live above this module; `dataset_where` names
    the dataset in its error)."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if isinstance(data, dict) and "eval" in data:
        data = data["eval"] or {}
    if not isinstance(data, dict) or not isinstance(data.get("datasets"), list) or not data["datasets"]:
        raise EvalConfigError(f"--eval-config {path}: expected `datasets:` (under an optional `eval:`) listing "
                              "at least one dataset with name and path")
    unknown = sorted(set(data) - {"defaults", "datasets"})
    if unknown:
        raise EvalConfigError(f"--eval-config {path}: unknown top-level key(s) {unknown}; use defaults, datasets")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise EvalConfigError(f"--eval-config {path}: `defaults` should be a mapping")
    base_dir = os.path.dirname(os.path.abspath(path))
    datasets = []
    for i, ds in enumerate(data["datasets"]):
        name = ds.get("name", "?") if isinstance(ds, dict) else "?"
        merged = {**defaults, **ds} if isinstance(ds, dict) else ds
        datasets.append(_check_dataset(dataset_where(path, i, name), merged, base_dir))
    names = [d["name"] for d in datasets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise EvalConfigError(f"--eval-config {path}: dataset name(s) {duplicates} used more than once")
    return datasets


def eval_datasets(args: argparse.Namespace) -> list[dict]:
    """The eval datasets of a run: `args.eval_datasets` (set from --eval-config when the flags are
    validated), else the `--eval-prompt-data` name/path pairs."""
    datasets = args.eval_datasets
    if datasets:
        return datasets
    values = list(args.eval_prompt_data or [])
    if len(values) == 1:
        values = ["aime", values[0]]
    return [{"name": n, "path": p} for n, p in zip(values[0::2], values[1::2])]


def args_for(args: argparse.Namespace, dataset: dict) -> argparse.Namespace:
    """A copy of `args` with the dataset's overrides applied to the eval flags they stand for."""
    out = copy.copy(args)
    for key, (_, attr) in _OVERRIDES.items():
        if dataset.get(key) is not None:
            value = dataset[key]
            setattr(out, attr, [value] if key == "stop" and isinstance(value, str) else value)
    return out
