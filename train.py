"""Synchronous RL training: generate → train → save → push weights, once per rollout (DESIGN §4).

    source scripts/models/qwen3-4B.sh
    python train.py --hf-checkpoint ... --prompt-data ... --rollout-batch-size 32 --n-samples-per-prompt 8 \
        --global-batch-size 256 ${MODEL_ARGS[@]}
    python train.py ... --dry-run     # validate, print the plan (layout, batches, memory), start nothing
"""

from __future__ import annotations

import logging
import math
import sys
import time

import ray

from slime.ray.launcher import Run
from slime.config.arguments import SlimeArgumentError, check_before_start, parse_args
from slime.config.plan import print_plan
from slime.utils.tracking import Tracker

logger = logging.getLogger("slime")


def train(args) -> None:
    tracker = Tracker(args)
    with Run(args) as run:
        resolve_num_rollout(args, run)  # first: the trainers size their LR schedules by it
        start_rollout_id = init_training(args, run)
        if start_rollout_id > 0:
            ray.get(run.rollout_manager.load.remote(start_rollout_id - 1))
        engines = ray.get(run.rollout_manager.get_engines.remote())
        weight_version = push_weights(run, engines, 0)
        if should_eval_before_training(args, start_rollout_id):
            tracker.log(evaluate(run, start_rollout_id), step=start_rollout_id)

        for rollout_id in range(start_rollout_id, args.num_rollout):
            step_start = time.time()
            batch, metrics = ray.get(run.rollout_manager.generate.remote(rollout_id))
            train_start = time.time()
            metrics.update(train_on(run, rollout_id, batch))
            metrics["perf/train_time"] = time.time() - train_start
            if should_save(args, rollout_id):
                save(run, rollout_id)
            if should_push(args, rollout_id):
                push_start = time.time()
                weight_version = push_weights(run, engines, weight_version)
                metrics["perf/update_weights_time"] = time.time() - push_start
            metrics["perf/step_time"] = time.time() - step_start
            if should_eval(args, rollout_id):
                metrics.update(evaluate(run, rollout_id))
            tracker.log(metrics, step=rollout_id)
    tracker.close()


def init_training(args, run: Run) -> int:
    """Build the actor (and PPO critic) models; returns the rollout id to start from."""
    start_rollout_id = run.actor.init(with_ref=needs_reference_model(args))
    if run.critic is not None:
        critic_start = run.critic.init(with_ref=False)
        if args.load and critic_start != start_rollout_id:
            logger.warning("--load %s: the actor resumes at rollout %d but the critic's checkpoint at %d (a "
                           "fresh critic when 0); the critic's value estimates lag until it catches up",
                           args.load, start_rollout_id, critic_start)
    return start_rollout_id


def needs_reference_model(args) -> bool:
    return bool(args.use_kl_loss or args.kl_coef)


def train_on(run: Run, rollout_id: int, batch) -> dict[str, float]:
    """One rollout's training. PPO: critic values → actor (advantages, returns, policy step) → critic step."""
    batch_ref = ray.put(batch)
    if run.critic is None:
        return run.actor.train(rollout_id, batch_ref)
    values_ref = run.critic.compute_values(batch_ref)
    metrics = run.actor.train(rollout_id, batch_ref, values_ref)
    metrics.update(run.critic.train(rollout_id, batch_ref, values_ref, run.actor.get_returns()))
    return metrics


def resolve_num_rollout(args, run: Run) -> None:
    """`--num-rollout` unset: num_epoch × dataset size ÷ rollout batch size."""
    if args.num_rollout is None:
        dataset_size = ray.get(run.rollout_manager.dataset_size.remote())
        args.num_rollout = math.ceil((args.num_epoch or 1) * dataset_size / args.rollout_batch_size)
        logger.info("--num-rollout resolved to %d (%s epochs of %d prompts)", args.num_rollout,
                    args.num_epoch or 1, dataset_size)


def push_weights(run: Run, engines: list, weight_version: int) -> int:
    """Send the actor's weights to every engine; engines then stamp responses with the new version.
    The rollout manager is told before and after, so a background (fully async) rollout pauses meanwhile."""
    weight_version += 1
    ray.get(run.rollout_manager.before_weight_update.remote())
    run.actor.update_weights(engines, weight_version)
    ray.get(run.rollout_manager.after_weight_update.remote(weight_version))
    return weight_version


def should_push(args, rollout_id: int) -> bool:
    """Every --update-weights-interval rollouts (slime's: the engines generate with older weights between)."""
    return (rollout_id + 1) % args.update_weights_interval == 0


def should_save(args, rollout_id: int) -> bool:
    if not args.save:
        return False
    last = rollout_id + 1 == args.num_rollout
    return last or (args.save_interval is not None and (rollout_id + 1) % args.save_interval == 0)


def should_eval_before_training(args, start_rollout_id: int) -> bool:
    return bool(args.eval_interval) and start_rollout_id == 0 and not args.skip_eval_before_train


def should_eval(args, rollout_id: int) -> bool:
    return bool(args.eval_interval) and (rollout_id + 1) % args.eval_interval == 0


def evaluate(run: Run, rollout_id: int) -> dict[str, float]:
    start = time.time()
    metrics = ray.get(run.rollout_manager.eval.remote(rollout_id))
    metrics["perf/eval_time"] = time.time() - start
    return metrics


def save(run: Run, rollout_id: int) -> None:
    """The data source's state first and the actor last: the actor's latest marker (written last of all) is
    what --load resumes from, so a run killed mid-save never names a checkpoint whose prompt position is
    missing (benchmarks/driver_kill_trials.py). The critic may end one save ahead of it."""
    ray.get(run.rollout_manager.save.remote(rollout_id))
    if run.critic is not None:
        run.critic.save(rollout_id)
    run.actor.save(rollout_id)


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
