"""Eval datasets with per-dataset settings (slime's `slime.utils.eval_config`): `--eval-config` YAML, or
`--eval-prompt-data name path ...`, resolved into `EvalDatasetConfig`s (`args.eval_datasets`).

    eval:                          # the top-level `eval:` key is optional
      defaults:                    # optional: any dataset field, for every dataset
        max_response_len: 1024
      datasets:                    # a list of entries with a name, or a mapping name -> entry
        - name: aime
          path: /root/aime-2024/aime-2024.jsonl
          rm_type: deepscaler
          n_samples_per_eval_prompt: 16
          temperature: 0.6
          stop: ["</answer>"]

Every field resolves as: the dataset's entry, else `defaults`, else the flags in `ARG_FALLBACKS` (first one
set; e.g. temperature: --eval-temperature, then --rollout-temperature); fields without flags stay None. A key
that is not a field, in a dataset or in `defaults`, is an error naming it (and, from a file, the file and the
dataset). A relative `path` is taken from the working directory when it exists there, else from the YAML's folder.

`args_for` gives the built-in eval rollout a copy of args with a dataset's settings on the flags it reads;
`NOT_ACTED_ON` lists the fields that rollout cannot honour (they are refused when it is the eval function).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from slime.utils.data import parse_prompt_path

logger = logging.getLogger(__name__)

# field -> the args attributes it falls back to, in order (slime's DATASET_RUNTIME_SPECS / DATASET_SAMPLE_SPECS)
ARG_FALLBACKS: dict[str, tuple[str, ...]] = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt", "n_samples_per_prompt"),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "min_eval_samples": (),
    "stop": ("rollout_stop",),
    "stop_token_ids": ("rollout_stop_token_ids",),
    "min_new_tokens": ("eval_min_new_tokens",),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": ("metadata_key",),
    "multimodal_keys": ("multimodal_keys",),
    "apply_chat_template": ("apply_chat_template",),
    "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "custom_rm_path": ("eval_custom_rm_path", "custom_rm_path"),
}

# field -> the args attribute `args_for` sets from it (what the built-in eval rollout reads)
_ARGS_FOR: dict[str, str] = {
    "input_key": "eval_input_key",
    "label_key": "eval_label_key",
    "metadata_key": "metadata_key",
    "tool_key": "tool_key",
    "n_samples_per_eval_prompt": "n_samples_per_eval_prompt",
    "temperature": "eval_temperature",
    "top_p": "eval_top_p",
    "top_k": "eval_top_k",
    "max_response_len": "eval_max_response_len",
    "stop": "rollout_stop",
    "stop_token_ids": "rollout_stop_token_ids",
    "skip_special_tokens": "rollout_skip_special_tokens",
    "apply_chat_template": "apply_chat_template",
    "apply_chat_template_kwargs": "apply_chat_template_kwargs",
}

# fields the built-in eval rollout does not act on (it sends no_stop_trim, repetition_penalty and min_new_tokens
# with each request: `sglang_rollout.eval_sampling_params`)
NOT_ACTED_ON = (
    "app_service", "eval_task_timeout", "min_eval_samples", "eval_early_stop_remaining",
    "eval_early_stop_idle_timeout", "message_processor", "reward_model", "remote_environment",
)  # fmt: skip

# type checks of the fields a YAML most often gets wrong
_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "path": (str,), "rm_type": (str,), "custom_rm_path": (str,), "input_key": (str,),
    "label_key": (str,), "tool_key": (str,), "metadata_key": (str,), "n_samples_per_eval_prompt": (int,),
    "temperature": (int, float), "top_p": (int, float), "top_k": (int,), "max_response_len": (int,),
    "stop": (str, list), "stop_token_ids": (list,), "min_new_tokens": (int,), "repetition_penalty": (int, float),
    "custom_generate_function_path": (str,), "metadata_overrides": (dict,), "multimodal_keys": (dict,),
    "apply_chat_template_kwargs": (dict,),
}  # fmt: skip


class EvalConfigError(ValueError):
    pass


@dataclass
class EvalDatasetConfig:
    """One eval dataset and its settings (None: not set)."""

    name: str
    path: str
    rm_type: str | None = None
    custom_rm_path: str | None = None

    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    multimodal_keys: dict[str, str] | None = None
    apply_chat_template: bool | None = None
    apply_chat_template_kwargs: dict[str, Any] | None = None

    n_samples_per_eval_prompt: int | None = None

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None

    custom_generate_function_path: str | None = None  # this dataset's generate function (e.g. tool calling)
    app_service: str | None = None  # generate through an app server at this URL

    eval_task_timeout: int | None = None
    min_eval_samples: int | None = None
    # stop early when fewer than `remaining` samples are left and none finished for `idle_timeout` seconds
    eval_early_stop_remaining: int | None = None
    eval_early_stop_idle_timeout: float | None = None

    # the dataset as its own data source (slime's per-source settings)
    message_processor: dict[str, Any] | None = None
    reward_model: dict[str, Any] | None = None
    remote_environment: dict[str, Any] | None = None

    metadata_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.metadata_overrides is None:
            self.metadata_overrides = {}
        if not isinstance(self.metadata_overrides, dict):
            raise TypeError(f"eval dataset {self.name}: metadata_overrides must be a mapping")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.min_eval_samples is not None and self.min_eval_samples <= 0:
            raise ValueError(f"eval dataset {self.name}: min_eval_samples must be positive when set")

    @property
    def cache_key(self) -> tuple[Any, ...]:
        """What identifies the loaded prompts of this dataset."""
        return (self.name, self.path, self.input_key, self.label_key, self.tool_key, self.metadata_key)

    def inject_metadata(self, sample_metadata: Any) -> dict[str, Any]:
        """A sample's metadata with this dataset's rm_type and metadata_overrides applied."""
        metadata = dict(sample_metadata) if isinstance(sample_metadata, dict) else {}
        if self.rm_type is not None:
            metadata["rm_type"] = self.rm_type
        metadata.update(self.metadata_overrides)
        return metadata


FIELDS = tuple(f.name for f in dataclasses.fields(EvalDatasetConfig))


def pick_from_args(args: Any, attrs: tuple[str, ...]) -> Any:
    """The first of `attrs` that `args` has set (not None), else None."""
    for attr in attrs:
        value = getattr(args, attr, None)
        if value is not None:
            return value
    return None


def ensure_dataset_list(config: Any) -> list[dict[str, Any]]:
    """`datasets` as a list of dicts: a list of entries (each with a name), or a mapping name -> entry."""
    if config is None:
        return []
    if isinstance(config, dict):
        return [{"name": name, **dict(entry or {})} for name, entry in config.items()]
    if isinstance(config, (list, tuple)):
        datasets = []
        for i, entry in enumerate(config):
            if not isinstance(entry, dict) or "name" not in entry:
                raise EvalConfigError(f"datasets[{i}]: each eval dataset needs a `name` (and a `path`), got {entry!r}")
            datasets.append(dict(entry))
        return datasets
    raise EvalConfigError(f"`datasets` must be a list or a mapping, got {type(config).__name__}")


def _check(where: str, entry: dict) -> None:
    unknown = sorted(set(entry) - set(FIELDS))
    if unknown:
        raise EvalConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(FIELDS)}")
    for key in ("name", "path"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise EvalConfigError(f"{where}: `{key}` is required (a string)")
    for key, types in _TYPES.items():
        value = entry.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise EvalConfigError(f"{where}: `{key}: {value!r}` should be {' or '.join(t.__name__ for t in types)}")
    if entry.get("n_samples_per_eval_prompt") is not None and entry["n_samples_per_eval_prompt"] < 1:
        raise EvalConfigError(f"{where}: `n_samples_per_eval_prompt` must be >= 1")


def build_eval_dataset_configs(
    args: Any, raw_config: Iterable[dict[str, Any]], defaults: dict[str, Any] | None, *, where: str = "eval config"
) -> list[EvalDatasetConfig]:
    """The datasets of `raw_config`, each field resolved (entry, then `defaults`, then `ARG_FALLBACKS`).
    `where` names the source in errors."""
    defaults = dict(defaults or {})
    unknown = sorted(set(defaults) - set(FIELDS))
    if unknown:
        raise EvalConfigError(f"{where}: unknown key(s) in eval.defaults: {unknown}; valid keys: {sorted(FIELDS)}")
    datasets = []
    for i, entry in enumerate(raw_config):
        entry = dict(entry or {})
        label = f"{where}: datasets[{i}] ({entry.get('name', '?')})"
        _check(label, {**defaults, **entry})
        resolved = {**defaults, **entry}
        for name, attrs in ARG_FALLBACKS.items():
            if name not in resolved:
                resolved[name] = pick_from_args(args, attrs)
        try:
            datasets.append(EvalDatasetConfig(**resolved))
        except (TypeError, ValueError) as e:
            raise EvalConfigError(f"{label}: {e}") from None
    names = [d.name for d in datasets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise EvalConfigError(f"{where}: dataset name(s) {duplicates} used more than once; give each a distinct name")
    return datasets


def load_eval_config(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the dataset entries, the defaults) of an `--eval-config` file; relative dataset paths that do not exist
    from the working directory are taken from the file's folder."""
    import yaml

    where = f"--eval-config {path}"
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise EvalConfigError(f"{where}: not valid YAML: {e}") from None
    if isinstance(data, dict) and "eval" in data:
        data = data["eval"] or {}
    if not isinstance(data, dict) or not data.get("datasets"):
        raise EvalConfigError(f"{where}: expected `datasets:` (under an optional `eval:`) listing at least one "
                              "dataset with name and path")  # fmt: skip
    unknown = sorted(set(data) - {"defaults", "datasets"})
    if unknown:
        raise EvalConfigError(f"{where}: unknown top-level key(s) {unknown}; use defaults, datasets")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise EvalConfigError(f"{where}: `defaults` should be a mapping")
    try:
        entries = ensure_dataset_list(data["datasets"])
    except EvalConfigError as e:
        raise EvalConfigError(f"{where}: {e}") from None
    base_dir = os.path.dirname(os.path.abspath(path))
    for i, entry in enumerate(entries):
        value = entry.get("path")
        if isinstance(value, str) and value and not os.path.isabs(value):
            file = _file_of(value, f"{dataset_where(where, i, entry['name'])}: path")
            if not os.path.exists(file) and os.path.exists(os.path.join(base_dir, file)):
                entry["path"] = os.path.join(base_dir, value)
    return entries, defaults


def _file_of(value: str, flag: str) -> str:
    try:
        return parse_prompt_path(value, flag)[0]
    except ValueError as e:
        raise EvalConfigError(str(e)) from None


def dataset_where(source: str, i: int, name: str) -> str:
    """How errors name dataset `i` of `source` (e.g. "--eval-config f.yaml")."""
    return f"{source}: datasets[{i}] ({name})"


def eval_source(args: argparse.Namespace) -> str:
    """Where the eval datasets come from, as errors name it."""
    return f"--eval-config {args.eval_config}" if args.eval_config else "--eval-prompt-data"


def _prompt_data_entries(values: list[str]) -> list[dict[str, str]]:
    if len(values) == 1:
        logger.info("--eval-prompt-data has a single path; naming that dataset 'aime' (as slime does).")
        values = ["aime", values[0]]
    if len(values) % 2:
        raise EvalConfigError(f"--eval-prompt-data {' '.join(values)}: expected name path pairs (got {len(values)} "
                              "values), e.g. --eval-prompt-data aime /data/aime.jsonl gsm8k /data/gsm8k.jsonl.")
    return [{"name": n, "path": p} for n, p in zip(values[0::2], values[1::2])]


def resolve_eval_datasets(args: argparse.Namespace) -> list[EvalDatasetConfig]:
    """The eval datasets of a run: from `--eval-config` when given, else the `--eval-prompt-data` name/path
    pairs (a lone path is named "aime"); every dataset file must exist."""
    if args.eval_config:
        entries, defaults = load_eval_config(args.eval_config)
    else:
        entries, defaults = _prompt_data_entries(list(args.eval_prompt_data or [])), {}
    source = eval_source(args)
    datasets = build_eval_dataset_configs(args, entries, defaults, where=source)
    for i, ds in enumerate(datasets):
        if args.eval_config:
            flag = f"{dataset_where(source, i, ds.name)}: path"
            missing = f"{flag} {ds.path!r}: no such file"
        else:
            flag, missing = "--eval-prompt-data", f"--eval-prompt-data {ds.name} {ds.path}: no such file"
        if not os.path.isfile(_file_of(ds.path, flag)):
            raise EvalConfigError(f"{missing} (cwd: {os.getcwd()}); fix the path.")
    return datasets


def not_acted_on(dataset: EvalDatasetConfig) -> list[str]:
    """The fields of `dataset` that are set but that the built-in eval rollout does not act on."""
    return [name for name in NOT_ACTED_ON if getattr(dataset, name) is not None]


def eval_datasets(args: argparse.Namespace) -> list[EvalDatasetConfig]:
    """The eval datasets of a run: `args.eval_datasets` (resolved when the flags are validated), else
    resolved now from `--eval-config` / `--eval-prompt-data` (args built without validation)."""
    if args.eval_datasets:
        return list(args.eval_datasets)
    if not args.eval_config and not args.eval_prompt_data:
        return []
    return resolve_eval_datasets(args)


def args_for(args: argparse.Namespace, dataset: EvalDatasetConfig) -> argparse.Namespace:
    """A copy of `args` with the dataset's settings on the flags the built-in eval rollout reads."""
    out = copy.copy(args)
    for name, attr in _ARGS_FOR.items():
        value = getattr(dataset, name)
        if value is not None:
            setattr(out, attr, value)
    return out
