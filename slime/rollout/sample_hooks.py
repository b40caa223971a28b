"""`--rollout-sample-hook-path` (repeatable): functions run on every generated sample before it is graded.

    [async] hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None

`generate_and_rm` calls `apply_rollout_sample_hooks(args, sample, evaluation=...)` right after generation (the
default generate or a custom one) and before the reward. Hooks run in the order given; each gets what the one
before it returned (`None` keeps the sample it was given). A hook is handed only the keyword arguments its
signature names (all of them when it takes `**kwargs`); `rollout_id` is the rollout being generated, which the
RolloutManager sets with `set_current_rollout_id` before it calls the rollout or eval function.

A list of samples (a group, or what a custom generate returned for one prompt) is walked leaf by leaf into a
new list of the same shape.
"""

from __future__ import annotations

import inspect
from typing import Any

from slime.utils.hooks import hooks_of
from slime.utils.types import Sample

FLAG = "--rollout-sample-hook-path"

_current_rollout_id: int | None = None


def set_current_rollout_id(rollout_id: int | None) -> None:
    """The rollout id hooks are told (one process generates one rollout or eval at a time)."""
    global _current_rollout_id
    _current_rollout_id = rollout_id


def current_rollout_id() -> int | None:
    return _current_rollout_id


def hook_paths(args: Any) -> list[str]:
    """The configured hooks. Plugins and slime's contract tests call the rollout helpers with args objects of
    their own, which may lack the flag: no attribute means no hooks."""
    paths = getattr(args, "rollout_sample_hook_path", None) or []
    return [paths] if isinstance(paths, str) else list(paths)


def _kwargs_for(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return {k: v for k, v in kwargs.items() if k in names}


async def _run_hooks(args: Any, sample: Sample, hooks: list[tuple[str, Any]], kwargs: dict[str, Any]) -> Sample:
    for path, hook in hooks:
        result = hook(args, sample, **_kwargs_for(hook, kwargs))
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            continue
        if not isinstance(result, Sample):
            raise TypeError(f"{FLAG}={path} returned {type(result).__name__}, expected Sample or None (return the "
                            "sample it was given, a replacement Sample, or None to keep it)")
        sample = result
    return sample


async def apply_rollout_sample_hooks(args: Any, value: Sample | list, **kwargs: Any) -> Sample | list:
    """Run the configured hooks on `value` (a Sample, or nested lists of them, rebuilt in the same shape);
    `value` itself when no hook is configured. `rollout_id` defaults to the current rollout's."""
    paths = hook_paths(args)
    if not paths:
        return value
    hooks = list(zip(paths, hooks_of(args).rollout_sample_hooks))  # loaded at the process's entry
    kwargs.setdefault("rollout_id", _current_rollout_id)
    return await _walk(args, value, hooks, kwargs)


async def _walk(args: Any, value: Sample | list, hooks: list[tuple[str, Any]], kwargs: dict[str, Any]) -> Sample | list:
    if isinstance(value, Sample):
        return await _run_hooks(args, value, hooks, kwargs)
    if isinstance(value, list):
        return [await _walk(args, item, hooks, kwargs) for item in value]
    raise TypeError(f"{FLAG}: hooks run on a Sample or a list of them, got {type(value).__name__}")
