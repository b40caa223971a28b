"""`RayTrainGroup`: the training ranks of one role (actor or critic) as Ray actors.

Rank 0 is created first and picks the rendezvous address (its node IP and a free port); ranks 1..N-1 get it.
Every call fans out to all ranks (torch.distributed collectives need all of them) and returns rank 0's result.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import ray

from slime.ray.placement_group import PlacementSlice

TRAIN_BACKENDS = {
    "fsdp": "slime.backends.fsdp_utils.actor:FSDPTrainRayActor",
    "megatron": "slime.backends.megatron_utils.actor:MegatronTrainRayActor",
}

# Passed to every training rank so that CPU runs do not oversubscribe the cores.
_FORWARDED_ENV = ("SLIME_TRAIN_NUM_THREADS", "SLIME_ENGINE_NUM_THREADS", "PYTHONPATH")


def load_backend_class(train_backend: str):
    module_name, cls_name = TRAIN_BACKENDS[train_backend].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


class RayTrainGroup:
    def __init__(self, args, placement: PlacementSlice, role: str = "actor", num_gpus_per_actor: float = 1.0):
        self.args = args
        self.role = role
        world_size = len(placement.bundle_indices)
        if world_size == 0:
            raise ValueError(f"{role}: no training ranks (--actor-num-nodes x --actor-num-gpus-per-node is 0)")
        remote_cls = ray.remote(load_backend_class(args.train_backend))
        env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
        self._actors = []
        master_addr = master_port = None
        for rank in range(world_size):
            actor = remote_cls.options(
                num_cpus=1 if not args.use_cuda else 0.2,
                num_gpus=num_gpus_per_actor if args.use_cuda else 0,
                scheduling_strategy=placement.strategy(rank),
                runtime_env={"env_vars": env} if env else None,
                name=None,
            ).remote(world_size, rank, master_addr, master_port)
            if rank == 0:
                master_addr, master_port = ray.get(actor.get_master_addr_and_port.remote())
            self._actors.append(actor)

    @property
    def actors(self) -> list:
        return list(self._actors)

    def _all(self, method: str, *args: Any) -> list:
        return ray.get([getattr(a, method).remote(*args) for a in self._actors])

    def init(self, with_ref: bool) -> int:
        """Build models on every rank; returns the rollout id to start from."""
        return self._all("init", self.args, self.role, with_ref)[0]

    def train(self, rollout_id: int, batch_ref: ray.ObjectRef) -> dict[str, float]:
        return self._all("train", rollout_id, batch_ref)[0]

    def update_weights(self, engines: list, weight_version: int) -> None:
        self._all("update_weights", engines, weight_version)

    def compute_log_probs(self, tokens: list[list[int]], response_lengths: list[int]) -> list[list[float]]:
        return self._all("compute_log_probs", tokens, response_lengths)[0]

    def save(self, rollout_id: int) -> None:
        self._all("save", rollout_id)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        refs = [a.shutdown.remote() for a in self._actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for a in self._actors:
            ray.kill(a)
        self._actors = []
