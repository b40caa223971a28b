"""`--update-weight-mode delta` (slime/weight_sync/delta.py, `DeltaPush` in slime/weight_sync/push.py).

The engines here are `ServerEngine`s whose server is left out: `apply_weight_delta` is the real method (it
applies the push to the local checkpoint on this host), and the server's `update_weights_from_disk` is replaced by
a reader that loads the local folder as a loader would at that moment, so the test sees what the server would
have loaded. The real server loading the local folder is tests/e2e_cpu/test_weight_delta_e2e.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.backends.server_engine import ServerEngine
from slime.utils.errors import SlimeArgumentError
from slime.weight_sync.delta import (ENCODINGS, MANIFEST, STATE, WeightDeltaError, apply_push, checksum_fn, decode,
                                     encode, tensor_bytes)
from slime.weight_sync.push import DeltaPush, DiskPush, push_weights, weight_route
from tests.args import make_args

HERE = __name__
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LocalEngine(ServerEngine):
    """A ServerEngine on this host whose server only reads the folder it is told to load."""

    def __init__(self, args, rank: int, url: str):
        super().__init__(args, rank)
        self.url, self.loads = url, []

    def get_url(self) -> str:
        return self.url

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> dict:
        with open(os.path.join(model_path, "model.safetensors.index.json")) as f:
            shards = set(json.load(f)["weight_map"].values())
        tensors = {}
        for shard in sorted(shards):
            tensors.update(load_file(os.path.join(model_path, shard)))
        self.loads.append((model_path, weight_version, tensors))
        return {"success": True}


def corrupt_delta(args, version_dir, rollout_engines):
    """Post-write hook: storage that flips one byte of every delta shard between the write and the engine's read."""
    with open(os.path.join(version_dir, MANIFEST)) as f:
        if json.load(f)["kind"] != "delta":
            return
    for name in os.listdir(version_dir):
        if name.endswith(".safetensors"):
            path = os.path.join(version_dir, name)
            tensors = load_file(path)
            for t in tensors.values():
                t[0] ^= 0x10
            save_file(tensors, path)


def _args(tmp_path, encoding="xor", checksum="xxh3-128", **kw):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"model_type": "toy"}')
    return make_args(hf_checkpoint=str(model), update_weight_transport="disk", update_weight_mode="delta",
                     update_weight_disk_dir=str(tmp_path / "push"),
                     update_weight_local_checkpoint_dir=str(tmp_path / "local"),
                     update_weight_delta_encoding=encoding, update_weight_delta_checksum=checksum, **kw)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(8, 4, generator=g),
            "model.layers.0.mlp.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(4, generator=g).to(torch.float16)}


def _push(route, engines, weights, version):
    route.begin(engines)
    return push_weights(iter(list(weights.items())), route, version, max_bytes=64)


def _files(folder) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest() for f in sorted(os.listdir(folder))}


# ---- encodings and checksums -----------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_decode_round_trips(dtype, encoding):
    old = torch.randn(6, 5).to(dtype)
    new = old.clone()
    new[2, 3] = 7.5
    new[5, 4] = -0.25
    a, b = tensor_bytes(old), tensor_bytes(new)
    change = encode(b, a, encoding)
    assert change.dtype == torch.uint8 and torch.equal(decode(change, a, encoding), b)
    assert torch.equal(decode(change, a, encoding).view(dtype).reshape(6, 5), new)
    changed_bytes = int((a != b).sum())
    # xor: one byte per byte of the tensor; overwrite: a 4-byte position and the new byte per changed byte
    assert change.numel() == (a.numel() if encoding == "xor" else 5 * changed_bytes)
    assert encode(a, a.clone(), encoding) is None  # unchanged: nothing to write
    scalar = torch.tensor(3.0, dtype=dtype)
    s_old, s_new = tensor_bytes(scalar), tensor_bytes(scalar + 1)
    assert torch.equal(decode(encode(s_new, s_old, encoding), s_old, encoding), s_new)


def test_a_delta_for_another_base_is_refused():
    a = tensor_bytes(torch.zeros(4))
    with pytest.raises(WeightDeltaError, match="xor delta of 8 bytes against a base of 16"):
        decode(torch.zeros(8, dtype=torch.uint8), a, "xor")
    with pytest.raises(WeightDeltaError, match="not a whole number"):
        decode(torch.zeros(7, dtype=torch.uint8), a, "overwrite")


def test_checksums():
    data = b"slime delta weights"
    assert checksum_fn("adler32")(data) == f"{zlib.adler32(data):08x}"
    xxh = checksum_fn("xxh3-128")
    assert len(xxh(data)) == 32 and xxh(data) != xxh(b"slime delta weightt")
    try:
        import blake3
    except ImportError:
        with pytest.raises(ImportError, match="needs the Python package 'blake3'.*pip install blake3"):
            checksum_fn("blake3")
    else:
        assert checksum_fn("blake3")(data) == blake3.blake3(data).hexdigest()


# ---- the push and the engine-side apply ------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_only_changed_tensors_are_written_and_the_engines_end_with_the_trainers_weights(tmp_path, encoding):
    args = _args(tmp_path, encoding=encoding)
    route = weight_route(args)
    assert isinstance(route, DeltaPush)
    engines = [LocalEngine(args, 0, "http://a:1"), LocalEngine(args, 1, "http://b:1")]  # one host, one local dir
    local = str(tmp_path / "local")

    weights = _weights()
    _push(route, engines, weights, 1)
    baseline = tmp_path / "push" / "weight_v000001"
    m1 = json.loads((baseline / MANIFEST).read_text())
    assert m1["kind"] == "full" and sorted(m1["tensors"]) == sorted(weights)
    assert (tmp_path / "local" / "config.json").is_file()

    weights["model.layers.0.mlp.weight"] = weights["model.layers.0.mlp.weight"] + 1  # 3 tensors, 1 changed
    _push(route, engines, weights, 2)
    delta = tmp_path / "push" / "weight_v000002"
    m2 = json.loads((delta / MANIFEST).read_text())
    assert m2["kind"] == "delta" and m2["base_id"] == m1["push_id"] and m2["encoding"] == encoding
    assert list(m2["tensors"]) == ["model.layers.0.mlp.weight"]
    shards = [f for f in os.listdir(delta) if f.endswith(".safetensors")]
    assert shards == [m2["tensors"]["model.layers.0.mlp.weight"]["file"]]
    assert list(load_file(str(delta / shards[0]))) == ["model.layers.0.mlp.weight"]
    assert not baseline.exists()  # applied on every host: the previous push's folder is removed

    for engine in engines:
        assert [(p, v) for p, v, _ in engine.loads] == [(local, "1"), (local, "2")]
        loaded = engine.loads[-1][2]
        for name, t in weights.items():
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    # both engines share the host's folder: the push was applied once (an xor applied twice would revert it)
    assert json.loads((tmp_path / "local" / STATE).read_text())["push_id"] == m2["push_id"]
    assert not [f for f in os.listdir(local) if ".tmp-" in f]

    before = _files(local)
    _push(route, engines, weights, 3)  # nothing changed: an empty delta, the engines still reload
    m3 = json.loads((tmp_path / "push" / "weight_v000003" / MANIFEST).read_text())
    assert m3["kind"] == "delta" and m3["tensors"] == {}
    assert {k: v for k, v in _files(local).items() if k != STATE} == {k: v for k, v in before.items() if k != STATE}
    assert [v for _, v, _ in engines[0].loads] == ["1", "2", "3"]


def test_checksum_mismatch_names_the_tensor_and_leaves_everything_as_it_was(tmp_path):
    args = _args(tmp_path, custom_update_weight_post_write_path=f"{HERE}.corrupt_delta")
    route, engine = weight_route(args), LocalEngine(args, 0, "http://a:1")
    local = str(tmp_path / "local")
    weights = _weights()
    _push(route, [engine], weights, 1)
    before = _files(local)
    expected = json.loads((tmp_path / "push" / "weight_v000001" / MANIFEST).read_text())

    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    with pytest.raises(WeightDeltaError) as info:
        _push(route, [engine], weights, 2)
    msg = str(info.value)
    new_sum = json.loads((tmp_path / "push" / "weight_v000002" / MANIFEST).read_text())["tensors"][
        "model.norm.weight"]["checksum"]
    assert "weight push v2" in msg and "'model.norm.weight'" in msg and "xxh3-128 checksum mismatch" in msg
    assert f"the push says {new_sum}" in msg and "the applied bytes give " in msg and "nothing was applied" in msg
    assert _files(local) == before  # byte-identical, no temporary file left behind
    assert [v for _, v, _ in engine.loads] == ["1"]  # the server was not asked to load anything
    assert json.loads((tmp_path / "local" / STATE).read_text())["push_id"] == expected["push_id"]

    # the failed push leaves the trainer without a trusted base: the next push is a full one, and it lands
    _push(route, [engine], weights, 3)
    assert json.loads((tmp_path / "push" / "weight_v000003" / MANIFEST).read_text())["kind"] == "full"
    assert torch.equal(engine.loads[-1][2]["model.norm.weight"], weights["model.norm.weight"])


def test_a_restarted_engine_gets_the_full_weights_again(tmp_path):
    args = _args(tmp_path, encoding="overwrite", update_weight_disk_keep_files=True)
    route = weight_route(args)
    weights = _weights()
    _push(route, [LocalEngine(args, 0, "http://a:1")], weights, 1)
    weights["model.embed_tokens.weight"][0, 0] = 42.0
    restarted = LocalEngine(args, 0, "http://a:2")  # a fault-tolerant restart: a new server
    _push(route, [restarted], weights, 2)
    assert json.loads((tmp_path / "push" / "weight_v000002" / MANIFEST).read_text())["kind"] == "full"
    assert torch.equal(restarted.loads[-1][2]["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])


def test_a_delta_on_a_base_the_host_does_not_hold_fails(tmp_path):
    args = _args(tmp_path, update_weight_disk_keep_files=True)
    route, engine = weight_route(args), LocalEngine(args, 0, "http://a:1")
    weights = _weights()
    _push(route, [engine], weights, 1)
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    _push(route, [engine], weights, 2)
    other = tmp_path / "other-host"
    with pytest.raises(WeightDeltaError, match=r"v2 .* is a delta on top of push \w+, but the local checkpoint "
                                               r".*other-host holds no complete push"):
        apply_push(str(tmp_path / "push" / "weight_v000002"), str(other))
    assert apply_push(str(tmp_path / "push" / "weight_v000002"), str(tmp_path / "local"))["applied"] is False


# ---- flags -----------------------------------------------------------------------------------------------------
def test_delta_mode_flags(tmp_path, caplog):
    assert isinstance(weight_route(make_args(update_weight_transport="disk", update_weight_disk_dir="/d")), DiskPush)
    with caplog.at_level(logging.WARNING):
        _args(tmp_path, encoding="overwrite", checksum="adler32")
    assert not [r for r in caplog.records if "applies to --update-weight-mode delta only" in r.getMessage()]
    with caplog.at_level(logging.WARNING):
        make_args(update_weight_delta_encoding="overwrite")
    assert [r for r in caplog.records if "--update-weight-delta-encoding applies to --update-weight-mode delta only"
            in r.getMessage()]
    try:
        import blake3  # noqa: F401
    except ImportError:
        with pytest.raises(SlimeArgumentError, match="blake3 needs the Python package 'blake3'.*pip install blake3"):
            _args(tmp_path, checksum="blake3")
    else:
        assert _args(tmp_path, checksum="blake3").update_weight_delta_checksum == "blake3"
