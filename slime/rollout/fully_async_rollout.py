"""Fully asynchronous rollout: a background worker keeps prompt groups in flight across rollout boundaries.

    --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async

Meant for `train_async.py`. The first call starts an `AsyncRolloutWorker` on the persistent event loop of
`slime.utils.async_utils.run_sync`; it keeps `--over-sampling-batch-size` groups (default
`--rollout-batch-size`) generating all the time, through the default `generate_and_rm_group` (so custom
generate / reward functions apply). Each call of the rollout function only takes `--rollout-batch-size`
finished groups from the worker, waiting for more when there are not enough.

Weight pushes (the RolloutManager calls the `before_weight_update` / `after_weight_update` this rollout
function declares with `@rollout_lifecycle`, slime/rollout/base_types.py):
- Before a push the worker stops launching groups, aborts every engine's requests (`/abort_request`) and
  waits until none of its groups is in flight, so weights never change under a running request.
- Groups cut short go back to the front of the queue. With `--partial-rollout` their samples continue from
  the tokens they have (the response then mixes weight versions; `sample.weight_versions` lists each one;
  `--mask-offpolicy-in-partial-rollout` masks the older part). Without it the unfinished samples restart
  from the prompt, so no response mixes versions.
- After the push the worker records the new version and resumes.

Staleness (`--max-policy-version-lag N`, slime/rollout/staleness.py): the consumer waits, nothing is dropped
here. When groups are collected, a finished group with a sample whose `policy_version` is more than
N - P pushes behind the engines' current version is regenerated from its prompts (counted in
`rollout/stale_groups_regenerated`), where P (`pushes_before_training`) bounds the pushes `train_async.py`
can still make before the collected rollout trains; the collection waits for the regenerated groups, so
what it hands out is within N at training time (train_async.py drops any group that is not). Finished
groups waiting to be collected are capped at `--async-buffer-size` x `--rollout-batch-size`: the worker stops
launching while the buffer is full, which also bounds staleness.

Simplifications:
- One worker per process (module state); it is stopped by its declared `shutdown` (RolloutManager.shutdown).
- Under `train.py`, which does not call the push hooks, weights change under running requests.
- The dynamic sampling filter runs when a group finishes; a dropped group is replaced by the next launch.
- The data source is read from the worker's loop thread; checkpoint `save` reads its counters from the
  actor's thread, so a save may count a group or two that is still in flight as handed out.
- Evaluation (`evaluation=True`) is the default rollout's, run next to the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, rollout_lifecycle
from slime.rollout.filter_hub.base_types import call_dynamic_filter, drop_metric, should_drop_dynamic_filter_output
from slime.rollout.generation import abort_engines, build_sampling_params, check_failed_ratio, generate_and_rm_group
from slime.rollout.train_rollout import generate_rollout
from slime.utils.async_utils import run_sync
from slime.rollout.staleness import collection_lag_bound, pushes_before_training, stale_groups
from slime.utils.metrics import wait_time_ratio
from slime.utils.hooks import hooks_of
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

ABORT_RETRY_S = 0.5  # re-send the abort while groups are still in flight (a request may have slipped past it)

_worker: "AsyncRolloutWorker | None" = None
_current_version: int | None = None


# --- pure helpers ---------------------------------------------------------------------------------------


def reset_sample(sample: Sample) -> Sample:
    """Forget a sample's response so it is generated again from its prompt (labels and metadata stay)."""
    sample.tokens = []
    sample.response = ""
    sample.response_length = 0
    sample.loss_mask = None
    sample.rollout_log_probs = None
    sample.weight_versions = []
    sample.token_policy_versions = None
    sample.reward = None
    sample.status = Sample.Status.PENDING
    return sample


def group_oldest_version(group: list[Sample]) -> int | None:
    versions = [v for v in (s.policy_version for s in group) if v is not None]
    return min(versions) if versions else None


def is_stale(group: list[Sample], current_version: int | None, max_staleness: int | None) -> bool:
    """True when part of the group came from weights more than `max_staleness` pushes before `current_version`."""
    return bool(stale_groups([0] * len(group), [s.policy_version for s in group], current_version, max_staleness))


def requeue_unfinished(group: list[Sample], partial_rollout: bool) -> list[Sample]:
    """A group cut short by an abort, ready to be launched again: aborted samples keep their partial
    response with `partial_rollout`, else restart from the prompt. Finished samples are kept as they are."""
    for s in group:
        if s.status == Sample.Status.ABORTED and not partial_rollout:
            reset_sample(s)
    return group


# --- the worker -----------------------------------------------------------------------------------------


class AsyncRolloutWorker:
    """Keeps `target_in_flight` groups generating; all methods run on the background event loop."""

    def __init__(self, args, data_source, weight_version: int | None):
        self.args = args
        self.data_source = data_source
        self.params = build_sampling_params(args)
        self.target_in_flight = args.over_sampling_batch_size  # validated: >= --rollout-batch-size
        self.max_buffered = args.async_buffer_size * int(args.rollout_batch_size)
        self.partial_rollout = bool(args.partial_rollout)
        self.max_staleness = collection_lag_bound(
            args.max_policy_version_lag, pushes_before_training(args.async_buffer_size, args.update_weights_interval))
        self.filter_fn = hooks_of(args).dynamic_sampling_filter
        self.weight_version = weight_version
        self.in_flight: set[asyncio.Task] = set()
        self.requeued: list[list[Sample]] = []  # cut short by a push: launched before fresh prompts
        self.finished: list[list[Sample]] = []  # waiting to be collected
        self.paused = False
        self.stopped = False
        self.error: BaseException | None = None
        self._changed = asyncio.Event()
        self._counters: dict[str, float] = {}
        self._idle_since: float | None = time.monotonic()
        self._idle_total = 0.0
        self._window_start = time.monotonic()

    # -- launching ---------------------------------------------------------------------------------------
    def top_up(self) -> None:
        """Launch groups until `target_in_flight` are running (unless paused or the buffer is full)."""
        while not (self.paused or self.stopped) and len(self.in_flight) < self.target_in_flight:
            if len(self.finished) >= self.max_buffered:
                break
            if self.requeued:
                group = self.requeued.pop(0)
            else:
                groups = self.data_source.get_samples(1)
                if not groups:
                    break
                group = groups[0]
            task = asyncio.ensure_future(generate_and_rm_group(self.args, group, self.params))
            self.in_flight.add(task)
            task.add_done_callback(self._on_done)
        self._track_idle()

    def _on_done(self, task: asyncio.Task) -> None:
        self.in_flight.discard(task)
        if task.cancelled():
            pass
        elif task.exception() is not None:
            self.error = self.error or task.exception()
        else:
            try:
                self._accept(task.result())
            except Exception as e:  # noqa: BLE001 - a raising filter surfaces in collect(), not in the loop's log
                self.error = self.error or e
        self._changed.set()
        self.top_up()

    def _accept(self, group: list[Sample]) -> None:
        if any(s.status == Sample.Status.ABORTED for s in group):
            self._count("rollout/aborted_groups")
            self.requeued.append(requeue_unfinished(group, self.partial_rollout))
            return
        if self.filter_fn is not None:
            verdict = call_dynamic_filter(self.filter_fn, self.args, group)
            # a rejected group that asked to be kept when short is kept while the groups finished and in flight
            # (this one included) could not fill the next rollout without it
            remaining = len(self.finished) + len(self.in_flight) + 1
            if should_drop_dynamic_filter_output(verdict, remaining_batch_size=remaining,
                                                 target_data_size=int(self.args.rollout_batch_size)):
                self._count(drop_metric(verdict.reason))
                return
        self.finished.append(group)

    def _count(self, key: str, n: float = 1.0) -> None:
        self._counters[key] = self._counters.get(key, 0.0) + n

    def _track_idle(self) -> None:
        now = time.monotonic()
        if self.in_flight and self._idle_since is not None:
            self._idle_total += now - self._idle_since
            self._idle_since = None
        elif not self.in_flight and self._idle_since is None:
            self._idle_since = now

    # -- collecting --------------------------------------------------------------------------------------
    async def collect(self, num_groups: int, rollout_id: int) -> list[list[Sample]]:
        """The oldest `num_groups` finished groups; waits for the worker to produce them."""
        self.top_up()
        while True:
            if self.error is not None:
                raise RuntimeError(f"rollout {rollout_id}: a group's generation raised: {self.error!r}") from self.error
            self._regenerate_stale()
            if len(self.finished) >= num_groups:
                break
            if self.paused or self.stopped:
                raise RuntimeError(
                    f"rollout {rollout_id}: the fully async worker is paused for a weight push (before_weight_update "
                    "without after_weight_update); call after_weight_update before generating"
                )
            if not self.in_flight:
                raise RuntimeError(f"rollout {rollout_id}: the data source handed out no groups and none is in flight")
            self._changed.clear()
            await self._changed.wait()
        groups, self.finished = self.finished[:num_groups], self.finished[num_groups:]
        self.top_up()  # the buffer has room again
        return groups

    def _regenerate_stale(self) -> None:
        stale = [g for g in self.finished if is_stale(g, self.weight_version, self.max_staleness)]
        if not stale:
            return
        self.finished = [g for g in self.finished if not is_stale(g, self.weight_version, self.max_staleness)]
        for group in stale:
            self.requeued.append([reset_sample(s) for s in group])
        self._count("rollout/stale_groups_regenerated", len(stale))
        self.top_up()

    def take_metrics(self) -> dict[str, float]:
        """Counters since the last call, plus the fraction of that time with no group in flight."""
        now = time.monotonic()
        idle = self._idle_total + (now - self._idle_since if self._idle_since is not None else 0.0)
        metrics = dict(self._counters)
        metrics.setdefault("rollout/aborted_groups", 0.0)
        metrics["perf/rollout_wait_time_ratio"] = wait_time_ratio(idle, now - self._window_start)
        metrics["rollout/buffered_groups"] = float(len(self.finished))
        metrics["rollout/groups_in_flight"] = float(len(self.in_flight))
        self._counters = {}
        self._idle_total = 0.0
        self._idle_since = now if self._idle_since is not None else None
        self._window_start = now
        return metrics

    # -- weight pushes and shutdown ----------------------------------------------------------------------
    async def pause(self) -> None:
        """Stop launching, abort what runs, return once nothing is in flight."""
        self.paused = True
        while self.in_flight:
            await abort_engines(self.args)
            if self.in_flight:  # the abort's round trip may have let the last ones finish
                await asyncio.wait(set(self.in_flight), timeout=ABORT_RETRY_S)
        self._track_idle()

    async def resume(self, weight_version: int) -> None:
        self.weight_version = weight_version
        self.paused = False
        self.top_up()

    async def stop(self) -> None:
        self.stopped = True
        self.paused = True
        if self.in_flight:
            await abort_engines(self.args)
            tasks = list(self.in_flight)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._changed.set()


# --- the RolloutManager's calls and the rollout function ------------------------------------------------


def before_weight_update(args) -> None:
    if _worker is not None:
        run_sync(_worker.pause())


def after_weight_update(args, weight_version: int) -> None:
    global _current_version
    _current_version = int(weight_version)
    if _worker is not None:
        run_sync(_worker.resume(_current_version))


def shutdown_rollout(args) -> None:
    global _worker
    if _worker is not None:
        run_sync(_worker.stop())
        _worker = None


@rollout_lifecycle(before_weight_update=before_weight_update, after_weight_update=after_weight_update,
                   shutdown=shutdown_rollout)
def generate_rollout_fully_async(args, rollout_id: int, data_source,
                                 evaluation: bool = False) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """`--rollout-function-path`: `rollout_batch_size` finished groups from the background worker, with the
    counters of the collection as metrics: `rollout/aborted_groups` (cut short by pushes),
    `rollout/stale_groups_regenerated`, `rollout/dynamic_filter/drop_<reason>`, `rollout/buffered_groups`,
    `rollout/groups_in_flight`, `rollout/failed_samples_all` and `perf/rollout_wait_time_ratio` (share of
    the time since the previous collection with no group in flight)."""
    if evaluation:
        return generate_rollout(args, rollout_id, data_source, evaluation=True)
    return run_sync(_collect(args, rollout_id, data_source))


async def _collect(args, rollout_id: int, data_source) -> RolloutFnTrainOutput:
    global _worker
    if _worker is None or _worker.data_source is not data_source or _worker.stopped:
        _worker = AsyncRolloutWorker(args, data_source, _current_version)
        logger.info("fully async rollout: worker started, %d groups in flight", _worker.target_in_flight)
    groups = await _worker.collect(int(args.rollout_batch_size), rollout_id)
    failed = [s for g in groups for s in g if s.status == Sample.Status.FAILED]
    check_failed_ratio(args, failed, int(args.rollout_batch_size) * int(args.n_samples_per_prompt), f"rollout {rollout_id}")
    metrics = {**_worker.take_metrics(), "rollout/failed_samples_all": float(len(failed))}
    groups.sort(key=lambda g: g[0].group_index if g and g[0].group_index is not None else -1)
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)
