"""`--keep-old-actor`: host-memory copies of the policy's weights, so that the old log-probs of a rollout come
from the weights the engines generated it with rather than from the weights being trained.

slime's queue, kept as it is (users' runs depend on it): at start `old_actor` holds the loaded weights (and,
with `--update-weights-interval 1`, `rollout_actor` too); after every weight push
- interval 1: `old_actor` <- `rollout_actor`, `rollout_actor` <- the pushed weights;
- otherwise: `old_actor` <- the pushed weights.
With one rollout generated ahead of training (train_async.py, --async-buffer-size 1), the interval-1 queue gives
`old_actor` = the weights of the push before the last: those that generated the rollout being trained. In
train.py (generation after each push) it is one push older than the rollout's weights, as in slime.

Each rank copies its own tensors (its shards, its pipeline stage): `tensors()` returns them by name, live
(writing to them changes the model). Copies live in host memory; swapping `old_actor` in and back costs two
host<->device copies of the rank's weights per rollout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

Tensors = dict[str, torch.Tensor]


def snapshot(tensors: Tensors) -> Tensors:
    return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}


@torch.no_grad()
def load_into(tensors: Tensors, saved: Tensors) -> None:
    missing = sorted(set(tensors) ^ set(saved))
    if missing:
        raise RuntimeError(f"--keep-old-actor: the model's tensors changed since they were copied ({missing[:5]})")
    for name, t in tensors.items():
        t.copy_(saved[name])


class OldActor:
    def __init__(self, tensors: Callable[[], Tensors], update_weights_interval: int,
                 after_load: Callable[[], None] = lambda: None):
        self.tensors, self.interval, self.after_load = tensors, update_weights_interval, after_load
        self.old = snapshot(tensors())
        self.rollout = snapshot(tensors()) if update_weights_interval == 1 else None

    def pushed(self) -> None:
        """The current weights were just pushed to the engines: advance the queue."""
        if self.rollout is not None:
            self.old, self.rollout = self.rollout, snapshot(self.tensors())
        else:
            self.old = snapshot(self.tensors())

    @contextlib.contextmanager
    def loaded(self):
        """The model holds `old_actor`'s weights inside the block, its own again after it (bit for bit)."""
        live = self.tensors()
        current = snapshot(live)
        load_into(live, self.old)
        self.after_load()
        try:
            yield
        finally:
            load_into(live, current)
            self.after_load()
