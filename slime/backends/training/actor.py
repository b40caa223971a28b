"""The training-backend interface: one `TrainRayActor` per training rank (GPU, or CPU rank without GPUs).

`RayTrainGroup` (slime/ray/actor_group.py) creates the actors on placement-group bundles, hands every rank the
rendezvous address of rank 0 and calls the same methods on all ranks; backends (`fsdp`, `megatron`) subclass
this (the policy trainers through `PolicyTrainer`, policy.py, which implements `train`) and implement `init`,
`update_weights`, `compute_log_probs` and `save`. The orchestration never branches on which backend it holds.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.training.offload import Offloader, TrainState, memory_gb
from slime.utils.net import node_ip
from slime.weight_sync.frozen import FrozenPushes
from slime.weight_sync.group import open_rendezvous
from slime.weight_sync.push import DiskPush, EnginePush, weight_route


STORE_TIMEOUT_MINUTES = 30  # until init_process_group sets --distributed-timeout-minutes


class TrainRayActor:
    _push: EnginePush | DiskPush | None = None  # rank 0's route to the engines, see engine_push
    _offloader: Offloader | None = None  # --offload-train
    _frozen: FrozenPushes | None = None  # which tensors pushes leave out, made on the first push
    # onload leaves the optimizer's copies in flight (offload.py); the trainer calls optimizer_ready() before it
    # reads the optimizer
    defers_optimizer_onload = False

    def __init__(self, world_size: int, rank: int, master_addr: str | None, master_port: int | None):
        self.world_size = world_size
        self.rank = rank
        self._store: dist.TCPStore | None = None
        if rank == 0 and master_addr is None:
            # Rank 0 holds the rendezvous port from here on: the OS picks it when the store binds (port 0). A port
            # only looked up here and bound at init_process_group could be taken in between (an engine's, the
            # router's or any outgoing connection's ephemeral port; seen in CI as EADDRINUSE at start-up).
            master_addr = node_ip()
            self._store = open_rendezvous(master_addr, timeout_s=STORE_TIMEOUT_MINUTES * 60)
            master_port = self._store.port
        self.master_addr, self.master_port = master_addr, master_port
        os.environ.update(
            MASTER_ADDR=str(master_addr),
            MASTER_PORT=str(master_port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            # Ray pins one GPU per actor (CUDA_VISIBLE_DEVICES), so inside the actor it is always device 0.
            LOCAL_RANK="0",
        )

    def get_master_addr_and_port(self) -> tuple[str, int]:
        return self.master_addr, self.master_port

    def init_process_group(self, backend: str, timeout_minutes: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        elif backend == "nccl":
            backend = "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        store = self._store
        if store is None:  # rank 0 given its address (a test's or a launcher's) binds it only now
            store = dist.TCPStore(self.master_addr, int(self.master_port), is_master=self.rank == 0,
                                  wait_for_workers=False, timeout=timeout)
        store.set_timeout(timeout)
        dist.init_process_group(backend=backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timeout)

    # ---- the backend interface -------------------------------------------------------------------
    def init(self, args: Any, role: str, with_ref: bool, num_rollout: int | None = None) -> int:
        """Build model/optimizer (and reference model when `with_ref`), load checkpoints; `num_rollout` (default
        --num-rollout) sizes learning-rate schedules. Returns the rollout id to start from."""
        raise NotImplementedError

    def train(self, rollout_id: int, batch: Any) -> dict[str, float]:
        """Train on one rollout's `TrainBatch`; returns `train/*` metrics (meaningful on rank 0)."""
        raise NotImplementedError

    def update_weights(self, engines: list[Any], weight_version: int) -> None:
        """Push the current weights to every rollout engine, stamped with `weight_version`."""
        raise NotImplementedError

    def compute_log_probs(self, tokens: list[list[int]], response_lengths: list[int]) -> list[list[float]]:
        """Per-response-token log-probs of the current policy (temperature-scaled like the rollout)."""
        raise NotImplementedError

    def save(self, rollout_id: int) -> None:
        raise NotImplementedError

    def train_state(self) -> TrainState:
        """What this rank holds on its device: modules, megatron DDP chunks, torch optimizers (--offload-train)."""
        raise NotImplementedError

    def offload(self, weights: bool = True) -> dict[str, float]:
        """--offload-train: this rank's training state to host memory (a no-op without CUDA, or when off already);
        `weights=False` keeps the weights a push reads. Returns the GB that left the device and the allocator's
        figures after."""
        device = _device()
        if self._offloader is None:
            self._offloader = Offloader(device)
        moved = self._offloader.offload(self.train_state(), weights=weights)
        return {"moved_gb": moved / 1e9, **memory_gb(device)}

    def onload(self, weights_only: bool = False) -> dict[str, float]:
        """The training state back on the device (a no-op when it is there); `weights_only`: just the weights a
        push reads (a push while the engines hold their memory: fault tolerance's mid-rollout push)."""
        if self._offloader is None:
            return {"moved_gb": 0.0, **memory_gb(_device())}
        moved = self._offloader.onload(self.train_state(), weights_only=weights_only,
                                       defer_optimizer=self.defers_optimizer_onload)
        return {"moved_gb": moved / 1e9, **memory_gb(_device())}

    def optimizer_ready(self) -> None:
        """Before the optimizer is read: wait (on the GPU) for the copies a deferred onload left in flight."""
        if self._offloader is not None:
            self._offloader.optimizer_ready()

    def peak_gpu_memory_gb(self) -> float | None:
        """Peak GPU memory (GiB) torch allocated on this rank since the previous call (None without CUDA)."""
        if not torch.cuda.is_available():
            return None
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return peak

    def engine_push(self, engines: list[Any]) -> EnginePush | DiskPush:
        """Rank 0's route to the engines (`weight_route`, slime/weight_sync/push.py), made on the first push and
        begun for `engines`: HF checkpoint folders with --update-weight-transport disk, else handles for
        colocated engines or a broadcast group kept across pushes."""
        if self._push is None:
            self._push = weight_route(self.args)
        self._push.begin(engines)
        return self._push

    def shutdown(self) -> None:
        if self._push is not None:
            self._push.close()
            self._push = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
