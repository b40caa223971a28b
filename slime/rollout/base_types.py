"""The rollout-function protocol (`--rollout-function-path`, `--eval-function-path`), slime's shapes.

    fn(args, rollout_id, data_source, evaluation=False) -> RolloutFnTrainOutput | list[list[Sample]]
    fn(args, rollout_id, data_source, evaluation=True)  -> RolloutFnEvalOutput | {name: {"rewards", ...}}

A rollout function returns its samples (groups of `n_samples_per_prompt`, in order) and, optionally, metrics
that are logged with the rollout's own (`rollout/...` names); the legacy shapes without metrics (a list of
groups; the eval dict) are accepted too. A function may be a coroutine function. `call_rollout_fn` calls one
and hands back the typed output.

A rollout function that keeps work going between its calls (the fully async rollout keeps generating in the
background) is told about weight pushes: the RolloutManager calls `before_weight_update(args)` right before a
push (the engines' weights must not change under a request), `after_weight_update(args, weight_version)` right
after it (the version the engines now stamp on their output), and `shutdown(args)` before its engines go away.
It declares them in one of two ways, read by one function (`lifecycle_of`, which the RolloutManager calls):
- slime's: functions named `before_weight_update` / `after_weight_update` in the rollout function's module;
- `@rollout_lifecycle(before_weight_update=..., after_weight_update=..., shutdown=...)` on the function, which
  also names `shutdown` and wins over the module's functions.
A rollout function with neither is not told (a plain synchronous rollout has nothing in flight at a push).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]  # dataset name -> {"rewards": [...], "truncated": [...], "samples": [...]}
    metrics: dict[str, Any] | None = None


def call_rollout_fn(fn: Callable, args: Any, rollout_id: int, data_source: Any, *, evaluation: bool
                    ) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Call a rollout (or eval) function, wait for it when it is a coroutine, and give its output the typed shape."""
    output = fn(args, rollout_id, data_source, evaluation=evaluation)
    if inspect.isawaitable(output):
        output = asyncio.run(output)
    if isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        return output
    return RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)


@dataclass(frozen=True)
class RolloutLifecycle:
    before_weight_update: Callable[[Any], None] | None = None
    after_weight_update: Callable[[Any, int], None] | None = None
    shutdown: Callable[[Any], None] | None = None


def rollout_lifecycle(**hooks: Callable) -> Callable[[Callable], Callable]:
    """Decorator: the calls a rollout function wants from the RolloutManager (see the module docstring)."""
    lifecycle = RolloutLifecycle(**hooks)

    def declare(fn: Callable) -> Callable:
        fn.rollout_lifecycle = lifecycle
        return fn

    return declare


MODULE_HOOKS = ("before_weight_update", "after_weight_update")


def lifecycle_of(fn: Callable) -> RolloutLifecycle:
    """What `fn` declared with `@rollout_lifecycle`, else the `before_weight_update` / `after_weight_update`
    functions of its module (slime's rollout-module hooks); nothing for a plain rollout function."""
    declared = getattr(fn, "rollout_lifecycle", None)
    if isinstance(declared, RolloutLifecycle):
        return declared
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    found = {name: getattr(module, name, None) for name in MODULE_HOOKS}
    return RolloutLifecycle(**{name: hook for name, hook in found.items() if callable(hook)})
