"""Small helpers shared across processes: loading plugin functions by path, the call contract of each
`*-path` hook (`HOOK_CONTRACTS`), checked by `load_hook` before anything starts, and `SingletonMeta`.
`decode_int32_meta_array` (SGLang's base64 int32 `meta_info` arrays) is `slime.utils.types`'s, importable
here at slime's path."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import threading
import traceback
from typing import Any

from slime.utils.types import decode_int32_meta_array  # noqa: F401 - slime's path for it

_FORMS = "pkg.module.fn, file.py (the function named like the file) or file.py:fn"
# flag -> the function a bare file.py may define instead of one named like the file
_FILE_FALLBACKS = {"--custom-generate-function-path": "generate", "sample.generate_function_path": "generate"}

# flag -> (positional arguments, keyword arguments, the call as the docs write it): every hook flag slime calls.
HOOK_CONTRACTS: dict[str, tuple[int, tuple[str, ...], str]] = {
    "--rollout-function-path": (3, ("evaluation",), "fn(args, rollout_id, data_source, evaluation=False)"),
    "--eval-function-path": (3, ("evaluation",), "fn(args, rollout_id, data_source, evaluation=True)"),
    "--custom-generate-function-path": (3, (), "async fn(args, sample, sampling_params[, evaluation=False])"),
    "--dynamic-sampling-filter-path": (2, (), "fn(args, group) -> bool | DynamicFilterOutput"),
    "--buffer-filter-path": (4, (), "fn(args, rollout_id, buffer, num_samples) -> groups"),
    "--data-source-path": (1, (), "DataSource(args)"),
    "--custom-rm-path": (2, (), "async fn(args, sample) -> float | dict (with --group-rm: fn(args, samples) -> list)"),
    "--custom-reward-post-process-path": (2, (), "fn(args, samples) -> (raw_rewards, rewards)"),
    "--custom-advantage-function-path": (
        2, (), "fn(args, rollout_data) -> None (sets rollout_data['advantages'] and rollout_data['returns'])"),
    "--custom-loss-function-path": (4, (), "fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)"),
    "--custom-tis-function-path": (
        1, ("pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths", "response_lengths"),
        "fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, "
        "**kwargs) -> (pg_loss, loss_masks, metrics)"),
    "--custom-pg-loss-reducer-function-path": (
        4, (), "fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer(pg_loss)"),
    "--rollout-sample-hook-path": (
        2, (), "[async] fn(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None"),
    "--rollout-sample-filter-path": (2, (), "fn(args, groups) -> None (sets sample.remove_sample)"),
    "--rollout-all-samples-process-path": (3, (), "fn(args, all_groups, data_source) -> None"),
    "--custom-convert-samples-to-train-data-path": (
        2, (), "fn(args, samples) -> dict (tokens, response_lengths, rewards, raw_reward, truncated, loss_masks)"),
    "--custom-rollout-log-function-path": (
        5, (), "fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool (True: skip default log)"),
    "--custom-eval-rollout-log-function-path": (
        4, (), "fn(rollout_id, args, data, extra_metrics) -> bool (True: skip default log)"),
    "--custom-update-weight-post-write-path": (3, (), "hook(args, version_dir, rollout_engines) -> None"),
    # the training side (slime/backends/training, slime/backends/megatron_utils)
    "--rollout-data-postprocess-path": (3, (), "fn(args, rollout_id, rollout_data) -> None (edits it in place)"),
    "--custom-megatron-init-path": (1, (), "fn(args)"),
    "--custom-megatron-before-log-prob-hook-path": (3, (), "fn(args, model, store_prefix)"),
    "--custom-megatron-before-train-step-hook-path": (
        6, (), "fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)"),
    "--custom-model-provider-path": (
        0, ("pre_process", "post_process"), "fn(pre_process=..., post_process=...[, vp_stage=...]) -> GPTModel"),
}


class SingletonMeta(type):
    """Metaclass of a per-process singleton (slime's `GenerateState(args)`): the first call builds the instance,
    every later call returns it whatever its arguments. `Cls.clear_instances()` forgets it (the next call builds a
    new one; tests do, between cases that build it from different args)."""

    _instances: dict[type, Any] = {}
    _lock = threading.RLock()  # an __init__ may build another singleton

    def __call__(cls, *args, **kwargs):
        with SingletonMeta._lock:
            if cls not in SingletonMeta._instances:
                SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
            return SingletonMeta._instances[cls]

    def clear_instances(cls) -> None:
        with SingletonMeta._lock:
            SingletonMeta._instances.pop(cls, None)


def load_function(path: str, flag: str | None = None) -> Any:
    """Load an attribute named by a `*-path` flag.

    Accepted forms: `pkg.mod.fn` (dotted import path, modules in the working directory included),
    `file.py` (the attribute named like the file's stem, as in `--custom-generate-function-path
    custom_generate.py`; for that flag `generate` too), `file.py:fn` and `pkg.mod:fn`. Errors name the flag,
    the path and what exists.
    """
    where = f"{flag}={path}" if flag else path
    try:
        module_part, attr = _split(path)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    try:
        module = _import(module_part)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise ImportError(
            f"{where}: cannot import '{module_part}': {type(e).__name__}: {e}{_raised_at(e)}; {_import_fix(e)}"
        ) from e
    if not hasattr(module, attr) and path.endswith(".py") and hasattr(module, _FILE_FALLBACKS.get(flag, "")):
        attr = _FILE_FALLBACKS[flag]  # custom_generate.py may name its function `generate`
    if not hasattr(module, attr):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AttributeError(
            f"{where}: '{module_part}' has no attribute '{attr}' (callables there: {public}); fix the name after "
            "the last '.' or ':'"
        )
    return getattr(module, attr)


def load_hook(path: str, flag: str) -> Any:
    """`load_function`, then check that the hook can be called the way slime calls it (`HOOK_CONTRACTS`)."""
    fn = load_function(path, flag)
    check_hook_signature(fn, path, flag)
    return fn


def check_hook_signature(fn: Any, path: str, flag: str) -> None:
    """Raise TypeError naming the flag, the function's parameters and the expected call when `fn` cannot take
    the arguments slime passes to `flag`'s hook. Unlisted flags and C functions are not checked."""
    if flag not in HOOK_CONTRACTS:
        return
    positional, keywords, call = HOOK_CONTRACTS[flag]
    where = f"{flag}={path}"
    if not callable(fn):
        raise TypeError(f"{where}: is a {type(fn).__name__}, not a function; slime calls it as {call}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(positional), **{k: None for k in keywords})
    except TypeError as e:
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", path))
        takes = f"{positional} positional argument(s)" + "".join(f" and the keyword {k}" for k in keywords)
        raise TypeError(
            f"{where}: {name}{signature} cannot be called as {call} ({e}); change its parameters to match "
            f"(it must take {takes})"
        ) from None


def _raised_at(error: BaseException) -> str:
    """' (at file:line)' of where an import failed inside the user's code, when that is known."""
    if isinstance(error, SyntaxError) and error.filename:
        return f" (at {error.filename}:{error.lineno})"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "importlib" not in f.filename]
    frames = [f for f in frames if os.path.abspath(f.filename) != os.path.abspath(__file__)]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _import_fix(error: BaseException) -> str:
    if isinstance(error, FileNotFoundError):
        return f"fix the path (relative paths start at the working directory {os.getcwd()}); forms: {_FORMS}"
    if isinstance(error, ModuleNotFoundError):
        return (f"check the module path and that its folder is importable (the working directory is on sys.path; "
                f"set PYTHONPATH for others); forms: {_FORMS}")  # fmt: skip
    return "fix the error in that module (importing it must succeed on its own)"


def _split(path: str) -> tuple[str, str]:
    if ":" in path:
        module_part, attr = path.rsplit(":", 1)
        return module_part, attr
    if path.endswith(".py"):
        return path, os.path.splitext(os.path.basename(path))[0]
    if "." not in path:
        raise ValueError(f"'{path}' is not a dotted path (pkg.module.function), a file.py or file.py:function; "
                         "write it in one of those forms")
    module_part, attr = path.rsplit(".", 1)
    return module_part, attr


def _import(module_part: str):
    if module_part.endswith(".py"):
        file = os.path.abspath(module_part)
        if not os.path.exists(file):
            raise FileNotFoundError(file)
        name = "_slime_plugin_" + os.path.splitext(os.path.basename(file))[0]
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == file:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            # a half-executed module must not be found by the next load: that one would report a missing
            # attribute instead of this error
            sys.modules.pop(name, None)
            raise
        return module
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module_part)


def read_yaml(path: str, flag: str, error: type[Exception] = ValueError) -> Any:
    """The YAML document a flag names (None for an empty file); `error` names the flag, the path and what is wrong
    (missing file, invalid YAML)."""
    import yaml

    if not os.path.isfile(path):
        raise error(f"{flag} {path}: no such file (cwd: {os.getcwd()})")
    with open(path) as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise error(f"{flag} {path}: not valid YAML: {e}") from e
