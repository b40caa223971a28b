"""The colocated handoff's memory figures (docs/colocate.md, "What is logged"): how the trainer's moves name them per
step (slime/ray/handoff.py), and the nvidia-smi reading behind `process_gb` (slime/backends/training/offload.py)."""

from __future__ import annotations

import torch

from slime.backends.training.offload import memory_gb, used_by_pid
from slime.ray.handoff import MemoryHandoff
from tests.args import make_args


class _Trainers:
    """The part of `slime.ray.launcher.Run` the handoff calls for the trainers: each move returns rank 0's figures
    (here numbered by call, so that each logged value says which move it came from)."""

    def __init__(self):
        self.calls: list[str] = []

    def _figures(self, move: str) -> dict[str, float]:
        self.calls.append(move)
        n = len(self.calls)
        return {"moved_gb": float(n), "allocated_gb": 10.0 * n, "process_gb": 100.0 * n}

    def offload_training(self, weights: bool = True) -> dict[str, float]:
        return self._figures("offload" if weights else "offload_state")

    def onload_training(self) -> dict[str, float]:
        return self._figures("onload")


def test_each_move_of_a_step_logs_its_own_figures():
    """train.py's order: the initial push (state, then weights), then per step onload, state, weights. Rollout 0
    logs its own three moves (not the initial push's added in), and the two offloads around a push apart."""
    trainers = _Trainers()
    handoff = MemoryHandoff(make_args("--offload-train"), trainers)
    handoff.before_push()  # the initial push: calls 1 (state) and 2 (weights)
    handoff.after_push()
    handoff.trainers_on()  # rollout 0: 3 onload, 4 state, 5 weights
    handoff.before_push()
    handoff.after_push()
    assert trainers.calls == ["offload_state", "offload", "onload", "offload_state", "offload"]
    figures = {k: v for k, v in handoff.metrics().items() if k.startswith("perf/actor_")}
    assert figures == {
        "perf/actor_onload_moved_gb": 3.0, "perf/actor_onload_allocated_gb": 30.0,
        "perf/actor_onload_process_gb": 300.0,
        "perf/actor_offload_state_moved_gb": 4.0, "perf/actor_offload_state_allocated_gb": 40.0,
        "perf/actor_offload_state_process_gb": 400.0,
        "perf/actor_offload_moved_gb": 5.0, "perf/actor_offload_allocated_gb": 50.0,
        "perf/actor_offload_process_gb": 500.0,
    }
    handoff.trainers_off()  # a step without a push: one offload of everything
    assert {k: v for k, v in handoff.metrics().items() if k.startswith("perf/actor_")} == {
        "perf/actor_offload_moved_gb": 6.0, "perf/actor_offload_allocated_gb": 60.0,
        "perf/actor_offload_process_gb": 600.0}


def test_process_memory_is_read_from_nvidia_smis_listing():
    listing = "4242, 1024\n17, 30\n4242, 512\n99, [N/A]\n"  # a process with contexts on two GPUs
    assert used_by_pid(listing, 4242) == 1536 * 2**20
    assert used_by_pid(listing, 17) == 30 * 2**20
    assert used_by_pid(listing, 99) is None  # no figure (MIG)
    assert used_by_pid(listing, 5) is None and used_by_pid("", 4242) is None
    assert memory_gb(torch.device("cpu")) == {}  # nothing on a CPU rank, no nvidia-smi call
