"""The rollout-function protocol (slime/rollout/base_types.py): slime's typed outputs and the legacy shapes,
coroutine functions, and the lifecycle a rollout function declares."""

from __future__ import annotations

from slime.rollout.base_types import (
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
    call_rollout_fn,
    lifecycle_of,
    rollout_lifecycle,
)
from slime.rollout.fully_async_rollout import generate_rollout_fully_async
from slime.rollout.sglang_rollout import generate_rollout
from slime.utils.types import Sample

GROUPS = [[Sample(group_index=0, index=0), Sample(group_index=0, index=1)]]


def legacy(args, rollout_id, data_source, evaluation=False):
    return {"set": {"rewards": [1.0]}} if evaluation else GROUPS


def typed(args, rollout_id, data_source, evaluation=False):
    if evaluation:
        return RolloutFnEvalOutput(data={"set": {"rewards": [0.5]}}, metrics={"eval/extra": 2.0})
    return RolloutFnTrainOutput(samples=GROUPS, metrics={"rollout/extra": 1.0})


async def coroutine(args, rollout_id, data_source, evaluation=False):
    return GROUPS


def test_legacy_shapes_become_typed_outputs():
    out = call_rollout_fn(legacy, None, 0, None, evaluation=False)
    assert isinstance(out, RolloutFnTrainOutput) and out.samples is GROUPS and out.metrics is None
    ev = call_rollout_fn(legacy, None, 0, None, evaluation=True)
    assert isinstance(ev, RolloutFnEvalOutput) and ev.data == {"set": {"rewards": [1.0]}}


def test_typed_outputs_pass_through_with_their_metrics():
    assert call_rollout_fn(typed, None, 0, None, evaluation=False).metrics == {"rollout/extra": 1.0}
    assert call_rollout_fn(typed, None, 0, None, evaluation=True).metrics == {"eval/extra": 2.0}


def test_a_coroutine_rollout_function_is_awaited():
    assert call_rollout_fn(coroutine, None, 0, None, evaluation=False).samples is GROUPS


def test_lifecycle_is_declared_not_looked_up():
    calls = []

    @rollout_lifecycle(before_weight_update=lambda args: calls.append("before"), shutdown=lambda args: None)
    def background(args, rollout_id, data_source, evaluation=False):
        return GROUPS

    declared = lifecycle_of(background)
    declared.before_weight_update(None)
    assert calls == ["before"] and declared.after_weight_update is None and declared.shutdown is not None
    plain = lifecycle_of(legacy)
    assert (plain.before_weight_update, plain.after_weight_update, plain.shutdown) == (None, None, None)
    # the built-in rollouts: the default one needs no calls, the fully async one is told about pushes and shutdown
    assert lifecycle_of(generate_rollout).before_weight_update is None
    full = lifecycle_of(generate_rollout_fully_async)
    assert None not in (full.before_weight_update, full.after_weight_update, full.shutdown)
