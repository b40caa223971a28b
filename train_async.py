"""Asynchronous RL training: the next rollout is generated while the current one trains (docs/async.md).

    python train_async.py <the flags of train.py> [--async-buffer-size N] [--update-weights-interval K]

Disaggregated only: training ranks and engines must run at the same time on their own devices, so
`--colocate` (and `--offload-rollout`) is refused. `--debug-train-only` runs without engines, as slime's SFT scripts
do: the rollout function prepares the next batch while this one trains. The loop, per rollout id:

1. take rollout k's data (waiting for it if generation is behind);
2. start generating the next rollouts, so that up to `--async-buffer-size` are generated or in flight
   ahead of training (1: one step off-policy, slime's behaviour);
3. train on rollout k; save on `--save-interval`;
4. every `--update-weights-interval` rollouts: wait for the generations in flight (their results are kept
   for the next steps), then push weights — weights never change in the middle of a generation;
5. evaluate on `--eval-interval`; log.

Every sample carries the weight versions it was generated with (`Sample.weight_versions`, stamped by the
engines; `Sample.policy_version` is the oldest, `Sample.token_policy_versions` one per token).
`--max-policy-version-lag N` bounds their lag at training time: before a rollout trains, whole groups with a
sample more than N pushes behind the current version get loss mask 0 (dropped, not regenerated: regenerating
here would stall training on a synchronous generation; the fully async rollout regenerates instead, before
this point). A rollout generated `--async-buffer-size` B steps ahead with a push every
`--update-weights-interval` K steps is at least B // K pushes behind once the run is going (one step off: exactly
1), so N below that would drop everything and is refused (slime/rollout/staleness.py).

Added metrics: `rollout/policy_version_lag_{min,mean,max}`, `rollout/stale_samples_dropped`,
`rollout/offpolicy_token_share` (docs/async.md), `rollout/weight_version_lag/{mean,max}` (the version last
pushed to the engines minus each sample's oldest version), `perf/train_wait_time_ratio` (share of the step the
trainer waited for generation) and `perf/rollout_wait_time_ratio` (share of the time the generation side waited
for the trainer; reported by the RolloutManager or the fully async rollout). One `timeline {...}` log line per
rollout gives the wall-clock spans of its generation, training and weight push.

Simplifications: the trainer's "current version" is the last pushed one, so with
`--update-weights-interval` > 1 the lag does not count trained-but-unpushed steps. The RolloutManager runs
one generation at a time; `--async-buffer-size` N > 1 queues the next ones behind it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import deque

import ray

from slime.config.arg_groups.cluster import offload_train_applies
from slime.config.arguments import SlimeArgumentError, check_before_start, parse_args
from slime.config.plan import print_plan
from slime.ray.launcher import Run
from slime.ray.loop import (
    evaluate,
    init_training,
    push_weights,
    resolve_num_rollout,
    save,
    should_eval,
    should_eval_before_training,
    should_push,
    should_save,
    train_on,
)
from slime.rollout.staleness import apply_policy_version_lag
from slime.utils.metrics import compute_weight_version_lag, wait_time_ratio
from slime.utils.tracking import Tracker

logger = logging.getLogger("slime")


def check_async_args(args) -> None:
    if args.colocate:
        raise SlimeArgumentError(
            "--colocate: train_async.py generates while it trains, so engines and training ranks cannot share "
            "devices; drop --colocate and give the engines their own (--rollout-num-gpus), or use train.py"
        )
    if args.offload_rollout:
        raise SlimeArgumentError(
            "--offload-rollout: train_async.py generates while it trains, so the engines never release their memory; "
            "drop it, or use train.py"
        )
    if args.offload_train:  # PPO turns it on; with generation overlapping training nothing is handed over
        logger.info("--offload-train: train_async.py keeps the training state resident (the engines have their own "
                    "GPUs); the actor and critic share theirs as they do without it")
    args.offload_train = offload_train_applies(args, asynchronous=True)
    args.offload = args.offload_train and args.offload_rollout
    if args.debug_rollout_only:
        raise SlimeArgumentError("--debug-rollout-only: there is no training to overlap generation with; use train.py")
    built_in_lag = args.async_buffer_size // args.update_weights_interval
    if args.max_policy_version_lag is not None and args.max_policy_version_lag < built_in_lag:
        raise SlimeArgumentError(
            f"--max-policy-version-lag {args.max_policy_version_lag}: train_async.py generates each rollout "
            f"--async-buffer-size {args.async_buffer_size} step(s) before it trains, with a push every "
            f"--update-weights-interval {args.update_weights_interval} step(s), so once it runs every sample is at "
            f"least {built_in_lag} version(s) behind when it trains and all would be dropped; use "
            f"--max-policy-version-lag {built_in_lag} or more (or train.py for on-policy training)"
        )
    # --debug-train-only (slime's SFT scripts): no engines; the rollout function (sft_rollout) prepares the next
    # batch while this one trains, and the pushes have no engine to reach.


class GenerationQueue:
    """Rollout generations started ahead of training: at most `ahead` generated or in flight at a time.

    Results of generations waited for at a weight push are kept (`ready`) until their step takes them.
    `wait_s` accumulates the time the driver spent blocked on generation.
    """

    def __init__(self, rollout_manager, start: int, end: int, ahead: int):
        self.rollout_manager = rollout_manager
        self.next_id = start
        self.end = end
        self.ahead = max(1, ahead)
        self.in_flight: deque[tuple[int, ray.ObjectRef]] = deque()
        self.ready: deque[tuple[int, tuple]] = deque()
        self.wait_s = 0.0

    def fill(self) -> None:
        while len(self.in_flight) + len(self.ready) < self.ahead and self.next_id < self.end:
            ref = self.rollout_manager.generate.remote(self.next_id, with_timing=True)
            self.in_flight.append((self.next_id, ref))
            self.next_id += 1

    def take(self, rollout_id: int) -> tuple:
        """(batch, metrics, timing) of `rollout_id`, the oldest one started."""
        if not self.ready:
            self.drain(1)
        got_id, result = self.ready.popleft()
        assert got_id == rollout_id, (got_id, rollout_id)
        return result

    def drain(self, count: int | None = None) -> None:
        """Wait for `count` (default: all) of the generations in flight."""
        n = len(self.in_flight) if count is None else min(count, len(self.in_flight))
        start = time.time()
        for _ in range(n):
            rollout_id, ref = self.in_flight.popleft()
            self.ready.append((rollout_id, ray.get(ref)))
        self.wait_s += time.time() - start


def train_async(args) -> None:
    check_async_args(args)
    tracker = Tracker(args)
    with Run(args) as run:
        num_rollout = resolve_num_rollout(args, run)
        start_rollout_id = init_training(args, run, num_rollout)
        engines = ray.get(run.rollout_manager.get_engines.remote())
        weight_version = push_weights(run, engines, 0)
        if should_eval_before_training(args, start_rollout_id):
            tracker.log(evaluate(run, start_rollout_id), step=start_rollout_id)

        generations = GenerationQueue(run.rollout_manager, start_rollout_id, num_rollout, args.async_buffer_size)
        generations.fill()
        step_start = time.time()
        for rollout_id in range(start_rollout_id, num_rollout):
            generations.wait_s = 0.0
            batch, metrics, timeline = generations.take(rollout_id)
            generations.fill()  # the next generation runs while this rollout trains
            metrics.update(compute_weight_version_lag(weight_version, metrics))
            metrics.update(apply_policy_version_lag(batch, weight_version, args.max_policy_version_lag))
            if metrics["rollout/stale_groups_dropped"]:
                logger.warning("rollout %d: %d group(s) more than --max-policy-version-lag %s versions behind version "
                               "%d are not trained (loss mask 0)", rollout_id, metrics["rollout/stale_groups_dropped"],
                               args.max_policy_version_lag, weight_version)

            timeline["train_start"] = time.time()
            metrics.update(train_on(run, rollout_id, batch))
            timeline["train_end"] = time.time()
            metrics["perf/train_time"] = timeline["train_end"] - timeline["train_start"]
            tracker.log(metrics, step=rollout_id, console=False)  # before the checkpoint (see train.py)
            late: dict[str, float] = {}
            if should_save(args, rollout_id, num_rollout):
                save(run, rollout_id)
            if should_push(args, rollout_id):
                generations.drain()  # never push in the middle of a generation
                timeline["push_start"] = time.time()
                weight_version = push_weights(run, engines, weight_version)
                timeline["push_end"] = time.time()
                late["perf/update_weights_time"] = timeline["push_end"] - timeline["push_start"]
            if should_eval(args, rollout_id):
                late.update(evaluate(run, rollout_id))
            generations.fill()

            step_end = time.time()
            late["perf/step_time"] = step_end - step_start
            late["perf/train_wait_time_ratio"] = wait_time_ratio(generations.wait_s, step_end - step_start)
            logger.info("timeline %s", json.dumps({"rollout_id": rollout_id, "weight_version": weight_version,
                                                   "trained_policy_version": int(metrics["rollout/policy_version"]),
                                                   **{k: round(v, 4) for k, v in timeline.items()}}))
            tracker.log(late, step=rollout_id)
            step_start = step_end
    tracker.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = parse_args(argv)
        check_async_args(args)
        if args.dry_run:  # validated above; print the plan, start nothing
            print_plan(args, "train_async.py")
            return
        check_before_start(args)
    except SlimeArgumentError as e:
        sys.exit(f"error: {e}")
    train_async(args)


if __name__ == "__main__":
    main()
