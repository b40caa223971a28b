"""Bring-up and teardown of the processes of one run (docs/architecture.md), used by train.py and train_async.py.

`Run` is a context manager: whatever has been started when an exception, Ctrl-C or SIGTERM arrives is shut
down in reverse order: the training ranks (rank 0 first dissolves its weight broadcast group with the engines,
which are still up), then the rollout manager with its engines and router, then Ray itself when we started it.
With `--advantage-estimator ppo` (`args.use_critic`) it also creates the critic group on the actor's bundles.
Each group gets its role's args: with `--megatron-config-path`, a copy with the role's overrides from the YAML.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import ray

from slime.ray.actor_group import RayTrainGroup
from slime.ray.placement_group import create_placement_groups
from slime.ray.rollout import RolloutManager
from slime.utils import process_reaper
from slime.utils.megatron_roles import role_args
from slime.utils.placement import num_bundles

logger = logging.getLogger("slime")


def start_ray(args) -> bool:
    """Connect to the cluster in RAY_ADDRESS, or start a local one sized for this run. Returns True if we started it."""
    if ray.is_initialized():
        return False
    # Workers import slime as installed (pip install -e .); Ray puts the driver's working directory and script
    # folder on their path, so plugins named by module path relative to either load there too.
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    needed = num_bundles(args) + 1
    ray.init(
        num_cpus=max(needed, os.cpu_count() or 1),
        num_gpus=None if args.use_cuda else 0,
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
    )
    return True


class Run:
    """Owns the processes of one run and reaps them on every exit path."""

    def __init__(self, args):
        self.args = args
        self.rollout_manager = None
        self.actor: RayTrainGroup | None = None
        self.critic: RayTrainGroup | None = None
        self._started_ray = False
        self._reaper: process_reaper.Reaper | None = None
        self._old_sigterm = None
        self.weight_check_pending = False  # --check-weight-update-equal: compare after the next push

    def __enter__(self) -> "Run":
        self._old_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
        try:
            self._started_ray = start_ray(self.args)
            if self._started_ray:  # a SIGKILLed driver must not leave Ray's agents behind (process_reaper.py)
                self._reaper = process_reaper.watch(process_reaper.ray_node_processes())
            placements = create_placement_groups(self.args)
            # The engines and the router start inside the manager's constructor; the training processes start
            # meanwhile, and `Run` returns without waiting for the manager (unless colocated, below), so the
            # trainers build their models while the engines load theirs (the caller asks for the engines after
            # `init_training`). The manager's first call waits for its constructor and raises its start-up error,
            # with its message.
            self.rollout_manager = create_rollout_manager(self.args, placements["rollout"])
            use_critic = bool(self.args.use_critic)
            # With a critic (or colocated engines) several processes share each GPU bundle.
            # Each group is built from its role's args (--megatron-config-path overrides; else the args themselves).
            self.actor = RayTrainGroup(role_args(self.args, "actor"), placements["actor"], role="actor",
                                       num_gpus_per_actor=0.4 if self.args.colocate or use_critic else 1.0)
            if use_critic:
                self.critic = RayTrainGroup(role_args(self.args, "critic"), placements["actor"], role="critic",
                                            num_gpus_per_actor=0.2)
            if self.args.colocate:
                # Engines on the trainers' GPUs size their memory pools from what is free when they start (SGLang's
                # static pool): the trainers build only once they are up (and, with the handoff, have released it).
                ray.get(self.rollout_manager.get_router_url.remote())
            if self.args.check_weight_update_equal:
                start_weight_check(self)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def offload_training(self, weights: bool = True) -> dict[str, float]:
        """--offload-train: the actor's (and critic's) training state to host memory (slime/ray/handoff.py);
        `weights=False` keeps the actor's weights for a push (the critic has none to push: all of it goes).
        Returns the actor's rank 0 figures (GB moved, the allocator's GB after)."""
        figures = [group.offload(weights) for group in (self.actor, self.critic) if group is not None]
        return figures[0] if figures else {}

    def onload_training(self) -> dict[str, float]:
        figures = [group.onload() for group in (self.actor, self.critic) if group is not None]
        return figures[0] if figures else {}

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown()
        signal.signal(signal.SIGTERM, self._old_sigterm or signal.SIG_DFL)

    def shutdown(self) -> None:
        # The trainers before the engines: rank 0 dissolves the weight broadcast group on both ends while the
        # engines can still answer (after them, closing it only meets killed engine actors).
        for name in ("critic", "actor"):
            group = getattr(self, name)
            if group is None:
                continue
            try:
                group.shutdown()
            except Exception as e:  # noqa: BLE001 - keep tearing down the rest
                logger.warning("%s group shutdown failed: %s", name, e)
            setattr(self, name, None)
        if self.rollout_manager is not None:
            try:
                ray.get(self.rollout_manager.shutdown.remote(), timeout=60)
            except Exception as e:  # noqa: BLE001 - keep tearing down the rest
                logger.warning("rollout manager shutdown failed: %s", e)
            ray.kill(self.rollout_manager)
            self.rollout_manager = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        if self._reaper is not None:
            self._reaper.release()
            self._reaper = None


def create_rollout_manager(args, placement):
    """The manager actor, constructing (engines and router starting); `ray.get` any call to wait for it."""
    return ray.remote(num_cpus=0)(RolloutManager).remote(args, (placement.pg, placement.bundle_indices))


def start_weight_check(run: Run) -> None:
    """--check-weight-update-equal: once the engines are up, snapshot their weights (the checkpoint
    they loaded) and overwrite them, so the first push must restore every tensor; `loop.push_weights` then
    compares (an engine that misses a tensor fails the run naming it)."""
    ray.get(run.rollout_manager.check_weights.remote(action="snapshot"))
    ray.get(run.rollout_manager.check_weights.remote(action="reset_tensors"))
    run.weight_check_pending = True
    logger.info("--check-weight-update-equal: engine weights snapshotted and reset; the first push is compared")


def _raise_on_sigterm(signum, frame):
    sys.exit(128 + signum)
