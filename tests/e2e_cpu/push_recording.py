"""A real engine with the tensors of each weight push noted, for tests that check what a push sends."""

from __future__ import annotations

import torch


class Recording:
    """The real engine, with each push's announced tensors noted (`pushes[-1]`: the push under way)."""

    def __init__(self, engine):
        self.engine = engine
        self.pushes: list[dict] = []

    def begin_push(self) -> None:
        self.pushes.append({"names": [], "bytes": 0})

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, weight_version=None):
        self.pushes[-1]["names"] += list(names)
        self.pushes[-1]["bytes"] += sum(torch.Size(s).numel() * getattr(torch, d).itemsize  # dtype names
                                        for d, s in zip(dtypes, shapes))
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name,
                                                           weight_version=weight_version)

    def __getattr__(self, name):
        return getattr(self.engine, name)
