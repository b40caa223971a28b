"""Fully async rollout: staleness/version metrics (closed form), sample requeueing, and the background worker's
scheduling driven through a custom generate function plugin (no engine: the worker is what is under test;
the engine-side abort is exercised by tests/e2e_cpu/test_train_async.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from slime.rollout.fully_async_rollout import (
    AsyncRolloutWorker,
    group_oldest_version,
    is_stale,
    requeue_unfinished,
    reset_sample,
)
from slime.utils.metrics import (
    compute_weight_version_lag,
    compute_weight_version_metrics,
    oldest_weight_version,
    wait_time_ratio,
)
from slime.utils.types import Sample
from tests.args import make_args

# --- closed-form metrics ----------------------------------------------------------------------------------


def test_oldest_weight_version_ignores_non_integer_stamps():
    assert oldest_weight_version(["3", "2", "4"]) == 2
    assert oldest_weight_version(["default", "5"]) == 5
    assert oldest_weight_version([]) is None
    assert oldest_weight_version(["default"]) is None


def test_weight_version_metrics_and_lag():
    m = compute_weight_version_metrics([["1"], ["2"], ["2", "3"], ["3"]])
    assert m["rollout/weight_version/min"] == 1.0
    assert m["rollout/weight_version/max"] == 3.0
    assert m["rollout/weight_version/mean"] == pytest.approx((1 + 2 + 2 + 3) / 4)
    assert m["rollout/mixed_version_samples"] == 1.0
    lag = compute_weight_version_lag(4, m)
    assert lag["rollout/weight_version_lag/max"] == 3.0
    assert lag["rollout/weight_version_lag/mean"] == pytest.approx(4 - 2.0)
    assert compute_weight_version_metrics([[], ["default"]]) == {}
    assert compute_weight_version_lag(4, {}) == {}


def test_wait_time_ratio_is_clamped():
    assert wait_time_ratio(1.0, 4.0) == 0.25
    assert wait_time_ratio(5.0, 4.0) == 1.0
    assert wait_time_ratio(1.0, 0.0) == 0.0


# --- requeueing and staleness ------------------------------------------------------------------------------


def _sample(status, versions, response_length=2):
    return Sample(group_index=0, index=0, prompt="p", tokens=[1, 2, 3, 4][: 2 + response_length], response="ab",
                  response_length=response_length, reward=1.0 if status != Sample.Status.ABORTED else None,
                  loss_mask=[1] * response_length, rollout_log_probs=[-0.1] * response_length,
                  weight_versions=list(versions), status=status)


def test_requeue_restarts_aborted_samples_unless_partial():
    group = [_sample(Sample.Status.COMPLETED, ["1"]), _sample(Sample.Status.ABORTED, ["1"])]
    requeue_unfinished(group, partial_rollout=False)
    assert group[0].status == Sample.Status.COMPLETED and group[0].response_length == 2  # finished: kept
    assert group[1].status == Sample.Status.PENDING and group[1].tokens == [] and group[1].weight_versions == []
    assert group[1].loss_mask is None and group[1].rollout_log_probs is None and group[1].reward is None

    group = [_sample(Sample.Status.ABORTED, ["1"])]
    requeue_unfinished(group, partial_rollout=True)
    assert group[0].status == Sample.Status.ABORTED and group[0].response_length == 2  # continued later


def test_staleness_uses_the_oldest_version_in_the_group():
    group = [_sample(Sample.Status.COMPLETED, ["3"]), _sample(Sample.Status.COMPLETED, ["1", "3"])]
    assert group_oldest_version(group) == 1
    assert is_stale(group, current_version=3, max_staleness=1)
    assert not is_stale(group, current_version=3, max_staleness=2)
    assert not is_stale(group, current_version=3, max_staleness=None)
    assert not is_stale([reset_sample(_sample(Sample.Status.COMPLETED, ["1"]))], 9, 0)  # no stamp: not stale


# --- the worker, with a custom generate function -----------------------------------------------------------

ENGINE = {"version": 1, "abort": False, "delay": 0.01, "calls": 0}


async def scripted_generate(args, sample, sampling_params):
    """A custom generate function: one token per call, stamped with ENGINE['version']; answers 'aborted' with
    no new token while ENGINE['abort'] is set (as an engine does after /abort_request)."""
    ENGINE["calls"] += 1
    await asyncio.sleep(ENGINE["delay"])
    if not sample.tokens:
        sample.tokens = [7]
        sample.loss_mask, sample.rollout_log_probs = [], []
    if ENGINE["abort"]:
        sample.status = Sample.Status.ABORTED
        return sample
    sample.tokens = sample.tokens + [8]
    sample.response += "x"
    sample.response_length += 1
    sample.loss_mask = sample.loss_mask + [1]
    sample.rollout_log_probs = sample.rollout_log_probs + [-0.5]
    sample.weight_versions.append(str(ENGINE["version"]))
    sample.status = Sample.Status.COMPLETED
    return sample


async def constant_reward(args, sample):
    return 1.0


class CountingDataSource:
    """A --data-source-path style source handing out numbered groups of n_samples_per_prompt prompts."""

    def __init__(self, n):
        self.n = n
        self.handed_out = 0

    def get_samples(self, num_groups):
        groups = []
        for _ in range(num_groups):
            g = self.handed_out
            groups.append([Sample(group_index=g, index=g * self.n + i, prompt=f"p{g}") for i in range(self.n)])
            self.handed_out += 1
        return groups


def _args(**kw):
    """Parsed args: 2 prompts x 2 samples, 3 groups in flight, the scripted generate and reward functions."""
    base = dict(over_sampling_batch_size=3, custom_generate_function_path=f"{__name__}.scripted_generate",
                custom_rm_path=f"{__name__}.constant_reward", rollout_max_response_len=4)
    return make_args(**{**base, **kw})


@pytest.fixture(autouse=True)
def _engine_reset():
    ENGINE.update(version=1, abort=False, delay=0.01, calls=0)


async def _until(condition, timeout_s: float = 30.0) -> None:
    """Wait on the event loop until `condition()` holds (a loaded machine may take long; a fast one returns at once)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_worker_keeps_groups_in_flight_across_collections_and_caps_its_buffer():
    async def scenario():
        source = CountingDataSource(2)
        worker = AsyncRolloutWorker(_args(), source, weight_version=1)
        first = await worker.collect(2, rollout_id=0)
        assert len(first) == 2 and all(len(g) == 2 for g in first)
        assert len(worker.in_flight) == 3  # refilled at once: generation carries on between rollouts
        await _until(lambda: len(worker.finished) >= 2)
        # buffer cap: async_buffer_size x rollout_batch_size = 2 finished groups; then launching stops
        assert len(worker.in_flight) + len(worker.finished) <= 2 + 3
        handed = source.handed_out
        await asyncio.sleep(0.2)
        assert source.handed_out == handed  # nothing launched while the buffer is full
        second = await worker.collect(2, rollout_id=1)
        assert {g[0].group_index for g in second}.isdisjoint({g[0].group_index for g in first})
        await worker.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("partial", [False, True])
def test_pause_aborts_requeues_and_resume_continues_or_restarts(partial):
    async def scenario():
        worker = AsyncRolloutWorker(_args(partial_rollout=partial), CountingDataSource(2), weight_version=1)
        worker.top_up()
        ENGINE["abort"] = True  # every request in flight answers 'aborted', as after /abort_request
        await worker.pause()
        assert not worker.in_flight and worker.paused
        assert len(worker.requeued) == 3 and worker.finished == []
        requeued = [s for g in worker.requeued for s in g]
        if partial:
            assert all(s.status == Sample.Status.ABORTED and s.tokens == [7] for s in requeued)
        else:
            assert all(s.status == Sample.Status.PENDING and s.tokens == [] for s in requeued)
        await asyncio.sleep(0.1)
        assert not worker.in_flight  # paused: nothing launched

        ENGINE.update(abort=False, version=2)
        await worker.resume(2)
        groups = await worker.collect(2, rollout_id=0)
        assert [g[0].group_index for g in groups] == [0, 1]  # the requeued groups go first
        assert all(s.weight_versions == ["2"] for g in groups for s in g)
        await worker.stop()

    asyncio.run(scenario())


def test_stale_groups_are_regenerated_with_current_weights():
    async def scenario():
        worker = AsyncRolloutWorker(_args(max_policy_version_lag=1), CountingDataSource(2), weight_version=1)
        worker.top_up()
        await _until(lambda: len(worker.finished) >= 2)
        await worker.pause()
        assert all(s.weight_versions == ["1"] for g in worker.finished for s in g)
        ENGINE["version"] = 3
        await worker.resume(3)  # two pushes later: version-1 groups are now 2 behind > 1
        groups = await worker.collect(2, rollout_id=0)
        assert all(s.weight_versions == ["3"] for g in groups for s in g)
        metrics = worker.take_metrics()
        assert metrics["rollout/stale_groups_regenerated"] >= 2
        assert 0.0 <= metrics["perf/rollout_wait_time_ratio"] <= 1.0
        await worker.stop()

    asyncio.run(scenario())


def test_collect_while_paused_is_an_error_not_a_hang():
    async def scenario():
        worker = AsyncRolloutWorker(_args(), CountingDataSource(2), weight_version=1)
        await worker.pause()
        with pytest.raises(RuntimeError, match="after_weight_update"):
            await asyncio.wait_for(worker.collect(2, rollout_id=0), timeout=5)

    asyncio.run(scenario())
