"""The steps of the training loop that `train.py` and `train_async.py` share (docs/training_loop.md): bring the
trainers up, train on one rollout, push weights, save, evaluate, and when to do each."""

from __future__ import annotations

import logging
import time

import ray

from slime.algorithm.estimators import needs_reference_model
from slime.ray.launcher import Run
from slime.utils.data import num_rollout_of_epochs

logger = logging.getLogger("slime")


def resolve_num_rollout(args, run: Run) -> int:
    """`--num-rollout`, or when it is unset slime's count: --num-epoch × the whole rollouts of one epoch (dataset
    size // rollout batch size; the data source knows the size once it has loaded the data)."""
    if args.num_rollout is not None:
        return args.num_rollout
    dataset_size = ray.get(run.rollout_manager.dataset_size.remote())
    num_rollout = num_rollout_of_epochs(args, dataset_size)
    if num_rollout <= 0:
        raise ValueError(f"--num-epoch {args.num_epoch}: --prompt-data holds {dataset_size} prompts, fewer than one "
                         f"rollout of --rollout-batch-size {args.rollout_batch_size}; lower the batch size or give "
                         "--num-rollout")
    logger.info("--num-rollout resolved to %d (%s epochs of %d rollouts of %d prompts)", num_rollout,
                args.num_epoch or 1, dataset_size // args.rollout_batch_size, dataset_size)
    return num_rollout


def init_training(args, run: Run, num_rollout: int) -> int:
    """Build the actor (and PPO critic) models, their LR schedules sized by `num_rollout`; load the data source's
    state when resuming. Returns the rollout id to start from."""
    start_rollout_id = run.actor.init(needs_reference_model(run.actor.args), num_rollout)  # the actor's role args
    if run.critic is not None:
        critic_start = run.critic.init(False, num_rollout)
        if args.load and critic_start != start_rollout_id:
            logger.warning("--load %s: the actor resumes at rollout %d but the critic's checkpoint at %d (a "
                           "fresh critic when 0); the critic's value estimates lag until it catches up",
                           args.load, start_rollout_id, critic_start)
    if start_rollout_id > 0:
        ray.get(run.rollout_manager.load.remote(start_rollout_id - 1))
    return start_rollout_id


def train_on(run: Run, rollout_id: int, batch) -> dict[str, float]:
    """One rollout's training. PPO: critic values → actor (advantages, returns, policy step) → critic step."""
    batch_ref = ray.put(batch)
    if run.critic is None:
        return run.actor.train(rollout_id, batch_ref)
    values_ref = run.critic.compute_values(batch_ref)
    metrics = run.actor.train(rollout_id, batch_ref, values_ref)
    metrics.update(run.critic.train(rollout_id, batch_ref, values_ref, run.actor.get_returns()))
    return metrics


def push_weights(run: Run, engines: list, weight_version: int) -> int:
    """Send the actor's weights to every engine; engines then stamp responses with the new version.
    The rollout manager is told before and after, so a background (fully async) rollout pauses meanwhile."""
    weight_version += 1
    ray.get(run.rollout_manager.before_weight_update.remote())
    run.actor.update_weights(engines, weight_version)
    ray.get(run.rollout_manager.after_weight_update.remote(weight_version))
    if getattr(run, "weight_check_pending", False):  # --check-weight-update-equal: the first push after the reset
        run.weight_check_pending = False
        try:
            ray.get(run.rollout_manager.check_weights.remote(action="compare"))
        except Exception as e:
            raise RuntimeError(f"--check-weight-update-equal: after the first push the engines do not hold the "
                               f"weights they loaded from --hf-checkpoint (the trainer starts from those too, unless "
                               f"--load names trained ones): {e}") from e
        logger.info("--check-weight-update-equal: every engine holds exactly the pushed weights")
    return weight_version


def should_push(args, rollout_id: int) -> bool:
    """Every --update-weights-interval rollouts (slime's: the engines generate with older weights between)."""
    return (rollout_id + 1) % args.update_weights_interval == 0


def should_save(args, rollout_id: int, num_rollout: int) -> bool:
    if not args.save:
        return False
    last = rollout_id + 1 == num_rollout
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
