"""The colocated memory handoff of `train.py` (`--offload-rollout`, `--offload-train`; on with `--colocate`).

Training and generation take turns with the GPUs, in slime's order:

    start:     engines up -> engines release everything -> trainers build their models
    each push: trainers offload all but their weights -> engines take their weights back -> push -> trainers
               offload their weights -> engines take their KV cache and CUDA graphs back
    each step: generate -> engines release everything -> trainers onload -> train -> save -> push (above)

Engines release with SGLang's calls (`release_memory_occupation` / `resume_memory_occupation`, tags `weights`,
`kv_cache`, `cuda_graph`; the rollout manager's `offload` / `onload_weights` / `onload_kv`). SGLang gives released
weights back uninitialised, so a push always follows `onload_weights`. An engine releases only once it serves no
request (SGLang asserts it): the rollout manager stops our generation and waits for each engine to be idle first
(docs/colocate.md). Trainers move their state to host memory (slime/backends/training/offload.py); during the push
only the trainers' weights and the engines' weights are on the GPU (slime pushes from a host copy; the push here
reads the trainer's weights on the device). Each phase is logged (`memory handoff: ...`) and timed; the seconds and
the actor's GPU memory after each of its moves are returned as `perf/*` metrics of the step:
`perf/actor_<move>_<figure>` for the moves `onload` (before training), `offload_state` (all but the weights, before
a push) and `offload` (the rest, or all without a push), the figures of rank 0 (`moved_gb` and those of
`memory_gb`, slime/backends/training/offload.py). Each is the step's own: the initial push's are replaced by
rollout 0's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

logger = logging.getLogger("slime")


class MemoryHandoff:
    def __init__(self, args: Any, run: Any):
        self.engines = bool(args.offload_rollout)
        self.trainers = bool(args.offload_train)
        self.run = run
        self.times: dict[str, float] = {}
        self.figures: dict[str, float] = {}  # the actor's GPU memory around its moves (CUDA only)

    @property
    def active(self) -> bool:
        return self.engines or self.trainers

    def _timed(self, name: str, what: str, fn) -> Any:
        logger.info("memory handoff: %s", what)
        start = time.time()
        result = fn()
        self.times[name] = self.times.get(name, 0.0) + time.time() - start
        return result

    def engines_release(self) -> None:
        if self.engines:
            self._timed("engine_release", "engines release weights, kv_cache, cuda_graph",
                        lambda: ray.get(self.run.rollout_manager.offload.remote()))

    def trainers_on(self) -> None:
        if self.trainers:
            self._memory("onload", self._timed("train_onload", "trainers onload", self.run.onload_training))

    def trainers_off(self, weights: bool = True) -> None:
        """Trainers to host memory: all of it, or (`weights=False`) all but the weights a push reads."""
        if self.trainers:
            what = "trainers offload" if weights else "trainers offload optimizer state, gradients"
            self._memory("offload" if weights else "offload_state",
                         self._timed("train_offload", what, lambda: self.run.offload_training(weights=weights)))

    def _memory(self, move: str, figures: dict[str, float]) -> None:
        """The actor's rank 0 after a move (`perf/actor_<move>_<figure>`): the last of its kind wins, so that each
        step reports its own moves."""
        self.figures.update({f"actor_{move}_{name}": value for name, value in (figures or {}).items()})

    def before_push(self) -> None:
        """Trainers keep only the weights the push reads on the GPU; engines take their weights back."""
        self.trainers_off(weights=False)
        if self.engines:
            self._timed("engine_resume", "engines resume weights",
                        lambda: ray.get(self.run.rollout_manager.onload_weights.remote()))

    def after_push(self) -> None:
        self.trainers_off()
        if self.engines:
            self._timed("engine_resume", "engines resume kv_cache, cuda_graph",
                        lambda: ray.get(self.run.rollout_manager.onload_kv.remote()))

    def metrics(self) -> dict[str, float]:
        """The step's handoff seconds (`perf/<phase>_time`, `perf/handoff_time` in all) and the actor's memory
        figures (`perf/actor_offload_allocated_gb`, ...); resets them."""
        out = {f"perf/{name}_time": seconds for name, seconds in self.times.items()}
        if self.times:
            out["perf/handoff_time"] = sum(self.times.values())
        out.update({f"perf/{name}": value for name, value in self.figures.items()})
        self.times, self.figures = {}, {}
        return out

