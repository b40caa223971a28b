"""The plugin hooks of a run, resolved once per process: `Hooks`, one field per hook flag of `HOOK_CONTRACTS`.

Each process resolves its record at its entry (the RolloutManager actor in its constructor, each training rank
in its backend's `init`) with `hooks_of(args)`: every hook flag that is set is loaded by `load_hook`, so a bad
path or signature fails there, naming the flag, the path and the fix, before any engine starts or any sample is
generated. Code below the entry reads the same record: where slime fixes a function's signature
(`generate_rollout(args, rollout_id, data_source, evaluation)`, `generate_and_rm(args, sample, params)`,
`async_rm(args, sample)`, `DataSource(args)`, ...) it calls `hooks_of(args)` again, which finds the record the entry
built (a lookup by the hook flags' values, not a second load); where the signature is this package's own, the
record is passed down.

Simplified or assumed:
- Every process resolves every hook flag that is set, including those another process calls (the training ranks
  load the rollout plugins too, as the driver's argument check already does): one record, one rule.
- The cache key is the values of the hook flags, so a copy of `args` (an eval dataset's `args_for`) finds the
  same record; args objects built by plugins without some of the flags count those as unset.
- Paths carried by samples (`Sample.custom_rm_path`, `Sample.generate_function_path`, set from an eval
  dataset's config or by a plugin) differ per sample: `sample_hook` loads each distinct path once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

from slime.utils.misc import HOOK_CONTRACTS, check_hook_signature, load_function, load_hook

Hook = Callable[..., Any] | None


def _hook(flag: str, default: Any = None) -> Any:
    assert flag in HOOK_CONTRACTS, flag
    return dataclasses.field(default=default, metadata={"flag": flag})


@dataclasses.dataclass(frozen=True)
class Hooks:
    """The loaded hook of each `*-path` flag, None where the flag is unset."""

    rollout_function: Hook = _hook("--rollout-function-path")
    eval_function: Hook = _hook("--eval-function-path")
    custom_generate_function: Hook = _hook("--custom-generate-function-path")
    dynamic_sampling_filter: Hook = _hook("--dynamic-sampling-filter-path")
    buffer_filter: Hook = _hook("--buffer-filter-path")
    data_source: Hook = _hook("--data-source-path")  # the DataSource class
    custom_rm: Hook = _hook("--custom-rm-path")
    custom_reward_post_process: Hook = _hook("--custom-reward-post-process-path")
    custom_advantage_function: Hook = _hook("--custom-advantage-function-path")
    custom_loss_function: Hook = _hook("--custom-loss-function-path")
    custom_tis_function: Hook = _hook("--custom-tis-function-path")
    custom_pg_loss_reducer_function: Hook = _hook("--custom-pg-loss-reducer-function-path")
    rollout_sample_hooks: tuple[Callable[..., Any], ...] = _hook("--rollout-sample-hook-path", ())  # a list flag
    rollout_sample_filter: Hook = _hook("--rollout-sample-filter-path")
    rollout_all_samples_process: Hook = _hook("--rollout-all-samples-process-path")
    custom_convert_samples_to_train_data: Hook = _hook("--custom-convert-samples-to-train-data-path")
    custom_rollout_log_function: Hook = _hook("--custom-rollout-log-function-path")
    custom_eval_rollout_log_function: Hook = _hook("--custom-eval-rollout-log-function-path")
    custom_update_weight_post_write: Hook = _hook("--custom-update-weight-post-write-path")
    rollout_data_postprocess: Hook = _hook("--rollout-data-postprocess-path")
    custom_megatron_init: Hook = _hook("--custom-megatron-init-path")
    custom_megatron_before_log_prob_hook: Hook = _hook("--custom-megatron-before-log-prob-hook-path")
    custom_megatron_before_train_step_hook: Hook = _hook("--custom-megatron-before-train-step-hook-path")
    custom_model_provider: Hook = _hook("--custom-model-provider-path")

    @classmethod
    def resolve(cls, args: Any) -> Hooks:
        """Load every hook whose flag is set in `args` (signature-checked); raises on the first bad one."""
        values = {}
        for f in dataclasses.fields(cls):
            flag = f.metadata["flag"]
            value = _flag_value(args, flag)
            if f.default == ():  # a list flag (a single path given as a string counts as one)
                paths = (value,) if isinstance(value, str) else value or ()
                values[f.name] = tuple(load_hook(path, flag) for path in paths)
            elif value:
                values[f.name] = load_hook(value, flag)
        return cls(**values)


def hook_flag(name: str) -> str:
    """The flag of a `Hooks` field."""
    return next(f.metadata["flag"] for f in dataclasses.fields(Hooks) if f.name == name)


def _flag_value(args: Any, flag: str) -> Any:
    """A hook flag's value in `args`: a path, a tuple of paths (a list flag) or None. Args objects that plugins
    build for the rollout helpers may lack hook flags: a missing one is unset."""
    value = vars(args).get(flag[2:].replace("-", "_"))
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


_records: dict[tuple, Hooks] = {}
_lock = threading.RLock()  # the RolloutManager's threads and event loop may ask at once


def hooks_of(args: Any) -> Hooks:
    """This process's `Hooks` for `args`: resolved on the first call (the process's entry makes it), then the same
    record for any args with the same hook flags."""
    key = tuple(_flag_value(args, f.metadata["flag"]) for f in dataclasses.fields(Hooks))
    with _lock:
        record = _records.get(key)
        if record is None:
            record = _records[key] = Hooks.resolve(args)
        return record


@functools.lru_cache(maxsize=None)
def sample_hook(path: str, flag: str, where: str) -> Callable[..., Any]:
    """The hook a sample names itself (`where`, e.g. "sample.custom_rm_path"), checked against `flag`'s contract;
    loaded once per distinct path per process (a failed load is not remembered: it fails again, as clearly)."""
    fn = load_function(path, where)
    check_hook_signature(fn, path, flag)
    return fn
