"""Synchronous RL training: generate → train → log → save → push weights, once per rollout (docs/training_loop.md);
colocated, the engines and the trainers hand the GPU memory back and forth around it (slime/ray/handoff.py).

    source scripts/models/qwen3-4B.sh
    python train.py --hf-checkpoint ... --prompt-data ... --rollout-batch-size 32 --n-samples-per-prompt 8 \
        --global-batch-size 256 ${MODEL_ARGS[@]}
    python train.py ... --dry-run     # validate, print the plan (layout, batches, memory), start nothing
"""

from __future__ import annotations

import logging
import sys
import time

import ray

from slime.config.arguments import SlimeArgumentError, check_before_start, parse_args
from slime.config.plan import print_plan
from slime.ray.handoff import MemoryHandoff
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
from slime.utils.tracking import Tracker

logger = logging.getLogger("slime")


def train(args) -> None:
    tracker = Tracker(args)
    with Run(args) as run:
        handoff = MemoryHandoff(args, run)  # --offload-rollout / --offload-train (on with --colocate)
        handoff.engines_release()  # the trainers build their models on a GPU the engines let go of
        num_rollout = resolve_num_rollout(args, run)
        start_rollout_id = init_training(args, run, num_rollout)
        engines = ray.get(run.rollout_manager.get_engines.remote())
        if args.use_fault_tolerance:  # the trainer is idle while a rollout generates: it can re-push mid-rollout
            ray.get(run.rollout_manager.set_weight_source.remote(run.actor.actors))
        handoff.before_push()
        weight_version = push_weights(run, engines, 0)
        handoff.after_push()
        if should_eval_before_training(args, start_rollout_id):
            tracker.log(evaluate(run, start_rollout_id), step=start_rollout_id)

        for rollout_id in range(start_rollout_id, num_rollout):
            step_start = time.time()
            batch, metrics = ray.get(run.rollout_manager.generate.remote(rollout_id))
            handoff.engines_release()
            handoff.trainers_on()
            train_start = time.time()
            metrics.update(train_on(run, rollout_id, batch))
            metrics["perf/train_time"] = time.time() - train_start
            tracker.log(metrics, step=rollout_id, console=False)  # before the checkpoint: a kill while saving
            late: dict[str, float] = {}  # leaves no gap in the curves
            if should_save(args, rollout_id, num_rollout):
                save(run, rollout_id)
            if should_push(args, rollout_id):  # always, when the engines released their weights (validation)
                handoff.before_push()
                push_start = time.time()
                weight_version = push_weights(run, engines, weight_version)
                late["perf/update_weights_time"] = time.time() - push_start
                handoff.after_push()
            else:
                handoff.trainers_off()
            late.update(handoff.metrics())
            late["perf/step_time"] = time.time() - step_start
            if should_eval(args, rollout_id):
                late.update(evaluate(run, rollout_id))
            tracker.log(late, step=rollout_id)
    tracker.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = parse_args(argv)
        if args.dry_run:  # validated above; print the plan, start nothing
            print_plan(args, "train.py")
            return
        check_before_start(args)
    except SlimeArgumentError as e:
        sys.exit(f"error: {e}")
    train(args)


if __name__ == "__main__":
    main()
