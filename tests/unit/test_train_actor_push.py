"""slime/backends/training/actor.py `engine_push`: rank 0's route to the engines is `weight_route(args)`, made on
the first push and kept: with --update-weight-transport disk every push is a checkpoint folder the engines load.

The engine is an in-process object with the one method the disk route calls (what a Ray handle would be asked).
"""

from __future__ import annotations

import os

import pytest
import torch

from slime.backends.training.actor import TrainRayActor
from slime.weight_sync.push import DiskPush, EnginePush, push_weights
from tests.args import make_args


class DiskEngine:
    def __init__(self):
        self.loads: list[tuple[str, str]] = []

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> dict:
        self.loads.append((model_path, weight_version))
        return {"success": True}


@pytest.fixture
def actor(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "")  # the actor sets them; restored after the test
    return TrainRayActor(world_size=1, rank=0, master_addr="127.0.0.1", master_port=1)


def test_the_disk_transport_is_the_route_of_every_push(actor, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    actor.args = make_args(hf_checkpoint=str(model), update_weight_transport="disk",
                           update_weight_disk_dir=str(tmp_path / "push"))
    engine = DiskEngine()
    for version in (1, 2):
        route = actor.engine_push([engine])
        push_weights(iter([("w", torch.ones(2))]), route, version, max_bytes=1 << 20)
    assert isinstance(route, DiskPush) and actor.engine_push([engine]) is route  # made once
    assert engine.loads == [(str(tmp_path / "push" / f"weight_v00000{v}"), str(v)) for v in (1, 2)]
    assert os.listdir(tmp_path / "push") == ["weight_v000002"]
    actor.shutdown()
    assert actor._push is None


def test_the_default_transport_keeps_the_engine_push(actor):
    actor.args = make_args(colocate=True)
    route = actor.engine_push([])
    assert isinstance(route, EnginePush) and route.colocated == 1  # the one engine shares the one training device
