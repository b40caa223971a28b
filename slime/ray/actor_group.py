"""`RayTrainGroup`: the training ranks of one role (actor or critic) as Ray actors.

Rank 0 is created first and picks the rendezvous address (its node IP and a free port); ranks 1..N-1 get it.
Every rank's environment holds `--train-env-vars` (over the variables forwarded from the driver's).
Every call fans out to all ranks (torch.distributed collectives need all of them) and returns rank 0's result.
The PPO critic group (role "critic") sits on the actor's bundles: without CUDA its ranks take no CPU of
their own (num_cpus 0), with CUDA a share of each GPU next to the actor's rank.
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


CRITIC_BACKENDS = {
    "fsdp": "slime.backends.fsdp_utils.critic:FSDPCriticRayActor",
}


def load_backend_class(train_backend: str, role: str = "actor"):
    backends = CRITIC_BACKENDS if role == "critic" else TRAIN_BACKENDS
    if train_backend not in backends:
        raise ValueError(
            f"--train-backend {train_backend} has no {role} implementation (there is one for: "
            f"{', '.join(backends)}); use --train-backend {next(iter(backends))}"
        )
    module_name, cls_name = backends[train_backend].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


class RayTrainGroup:
    def __init__(self, args, placement: PlacementSlice, role: str = "actor", num_gpus_per_actor: float = 1.0):
        self.args = args
        self.role = role
        world_size = len(placement.bundle_indices)
        if world_size == 0:
            raise ValueError(f"{role}: no training ranks (--actor-num-nodes x --actor-num-gpus-per-node is 0)")
        remote_cls = ray.remote(load_backend_class(args.train_backend, role))
        if args.use_cuda:
            num_cpus = 0.2
        else:
            num_cpus = 0 if role == "critic" else 1  # the critic shares the actor's CPU bundles
        env = {**{k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}, **args.train_env_vars}
        self._actors = []
        master_addr = master_port = None
        for rank in range(world_size):
            actor = remote_cls.options(
                num_cpus=num_cpus,
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

    def init(self, with_ref: bool, num_rollout: int) -> int:
        """Build models on every rank (LR schedules sized by `num_rollout`); returns the rollout id to start from."""
        return self._all("init", self.args, self.role, with_ref, num_rollout)[0]

    def train(self, rollout_id: int, batch_ref: ray.ObjectRef, *per_row_refs: ray.ObjectRef) -> dict[str, float]:
        """Train on one rollout. `per_row_refs`: the actor under ppo takes the critic's values; the critic
        takes its values and the actor's returns."""
        metrics = self._all("train", rollout_id, batch_ref, *per_row_refs)[0]
        peak = ray.get(self._actors[0].peak_gpu_memory_gb.remote())
        if peak is not None:  # since the previous rollout: training, log-prob passes and the weight push
            metrics[f"perf/{self.role}_peak_gpu_gb"] = peak
        return metrics

    def compute_values(self, batch_ref: ray.ObjectRef) -> ray.ObjectRef:
        """Critic: per-token values of every row (a reference to rank 0's list, for the actor and critic)."""
        refs = [a.compute_values.remote(batch_ref) for a in self._actors]
        ray.get(refs[1:])
        return refs[0]

    def get_returns(self) -> ray.ObjectRef:
        """Actor under ppo: the returns of every row from the last `train` (a reference, for the critic)."""
        return self._actors[0].get_returns.remote()

    def update_weights(self, engines: list, weight_version: int) -> None:
        self._all("update_weights", engines, weight_version)

    def offload(self, weights: bool = True) -> dict[str, float]:
        """--offload-train: every rank moves its training state to host memory (`weights=False`: all but the
        weights a push reads); rank 0's memory figures."""
        return self._all("offload", weights)[0]

    def onload(self) -> dict[str, float]:
        return self._all("onload")[0]

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
