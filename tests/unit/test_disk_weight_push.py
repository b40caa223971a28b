"""`--update-weight-transport disk`: each push is an HF checkpoint folder, published by
`--custom-update-weight-post-write-path` before the engines load it.

The engine here is an in-process object with the one method the route calls, `update_weights_from_disk`; it
reads the folder back as a loader does (index -> shards) at the moment it is asked to, so the test sees what
an engine would have found on disk then. The hf engine's own loader is tested with its server.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from slime.utils.errors import SlimeArgumentError
from slime.weight_sync.push import DiskPush, EnginePush, push_weights, weight_route
from tests.args import make_args

HERE = __name__


def publish(args, version_dir, rollout_engines):
    """The post-write hook: what an object-store mount would need before another host reads the files."""
    with open(os.path.join(version_dir, "PUBLISHED"), "w") as f:
        f.write(str(len(rollout_engines)))


def publish_no_engines(args, version_dir):
    return None


class ReadingEngine:
    def __init__(self):
        self.loads: list[tuple[str, str, dict, bool]] = []

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> dict:
        with open(os.path.join(model_path, "model.safetensors.index.json")) as f:
            index = json.load(f)["weight_map"]
        tensors = {}
        for shard in sorted(set(index.values())):
            tensors.update(load_file(os.path.join(model_path, shard)))
        assert set(tensors) == set(index)
        self.loads.append((model_path, weight_version, tensors, os.path.exists(os.path.join(model_path, "PUBLISHED"))))
        return {"success": True}


def _args(tmp_path, **kw):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"model_type": "toy"}')
    return make_args(hf_checkpoint=str(model), update_weight_transport="disk",
                     update_weight_disk_dir=str(tmp_path / "push"),
                     custom_update_weight_post_write_path=f"{HERE}.publish", **kw)


def _weights():
    embed = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    return [("model.embed_tokens.weight", embed), ("lm_head.weight", embed),  # tied: one storage
            ("model.norm.weight", torch.ones(3, dtype=torch.bfloat16))]


def test_each_push_is_a_published_checkpoint_the_engines_load(tmp_path):
    args = _args(tmp_path)
    route = weight_route(args)
    assert isinstance(route, DiskPush)
    engines = [ReadingEngine(), ReadingEngine()]

    route.begin(engines)
    sent = push_weights(iter(_weights()), route, 1, max_bytes=48)  # the embedding fills a bucket by itself
    folder = str(tmp_path / "push" / "weight_v000001")
    assert sent == 3 and sorted(os.listdir(folder)) == [
        "PUBLISHED", "config.json", "model-00001.safetensors", "model-00002.safetensors", "model-00003.safetensors",
        "model.safetensors.index.json"]
    for engine in engines:
        [(path, version, tensors, published)] = engine.loads
        assert (path, version, published) == (folder, "1", True)  # the hook ran before the engines read
        for name, tensor in _weights():
            assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor)
    assert open(os.path.join(folder, "PUBLISHED")).read() == "2"

    route.begin(engines)
    push_weights(iter(_weights()), route, 2, max_bytes=1 << 20)
    assert sorted(os.listdir(tmp_path / "push")) == ["weight_v000002"]  # the previous version is removed
    assert len(os.listdir(tmp_path / "push" / "weight_v000002")) == 4  # one shard, index, config, marker


def test_keep_files_keeps_every_version(tmp_path):
    args = _args(tmp_path, update_weight_disk_keep_files=True)
    route, engine = DiskPush(args), ReadingEngine()
    for version in (1, 2):
        route.begin([engine])
        push_weights(iter(_weights()), route, version, max_bytes=1 << 20)
    assert sorted(os.listdir(tmp_path / "push")) == ["weight_v000001", "weight_v000002"]


def test_default_transport_is_the_engine_push():
    assert isinstance(weight_route(make_args()), EnginePush)


@pytest.mark.parametrize(("fields", "match"), [
    ({"update_weight_transport": "disk"}, "--update-weight-transport disk needs --update-weight-disk-dir"),
    ({"custom_update_weight_post_write_path": f"{HERE}.publish"},
     "it runs after a disk push writes its files; add --update-weight-transport disk"),
    ({"update_weight_transport": "disk", "update_weight_disk_dir": "/tmp/x",
      "custom_update_weight_post_write_path": f"{HERE}.publish_no_engines"},
     r"publish_no_engines\(args, version_dir\) cannot be called as hook\(args, version_dir, rollout_engines\)"),
])
def test_disk_flags_are_checked_when_parsed(fields, match):
    with pytest.raises(SlimeArgumentError, match=match):
        make_args(**fields)
