"""train.py with `--update-weight-mode delta` on CPU: real Ray, real hf engine process, real fsdp training.

The trainer pushes a full checkpoint first, then only what changed; the engine's actor applies each push to the
local checkpoint and the server loads it from there. Shown: the engine's log-probs equal the trainer's after
every push (so the unlisted tensors were right too), and every delta lists exactly the tensors whose values
differ from the previous push, read independently off the trainer's own per-rollout checkpoints (--save).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from slime.utils.tracking import read_scalars
from slime.weight_sync.delta import MANIFEST, decode
from tests.e2e_cpu.test_train_e2e import _env, _train_cmd
from tests.e2e_cpu.together import result_of, run_together

ENCODINGS = ["xor", "overwrite"]
N_ROLLOUT = 3


def _shards(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _shard_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def _delta_run(root, tiny_model_dir, toy_data_path, encoding):
    """One train.py run pushing deltas with `encoding`; returns its folder."""
    tmp_path = root / encoding
    tmp_path.mkdir()
    tb, push, local, save = tmp_path / "tb", tmp_path / "push", tmp_path / "local", tmp_path / "ckpt"
    cmd = _train_cmd(tiny_model_dir, toy_data_path, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                     "--global-batch-size", "16", "--num-rollout", str(N_ROLLOUT), "--rm-type", "toy",
                     "--update-weight-transport", "disk", "--update-weight-mode", "delta",
                     "--update-weight-disk-dir", str(push), "--update-weight-local-checkpoint-dir", str(local),
                     "--update-weight-disk-keep-files", "--update-weight-delta-encoding", encoding,
                     "--save", str(save), "--save-interval", "1", "--no-save-optim",
                     "--use-tensorboard", "--tensorboard-dir", str(tb))
    # the hf server may load from L without SLIME_ENGINE_WEIGHT_DIRS: the weight-sync folders are allowed
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=str(tmp_path), timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return tmp_path


@pytest.fixture(scope="module")
def delta_runs(tiny_model_dir, toy_data_path, tmp_path_factory) -> dict:
    """Both encodings' runs at once (tests/e2e_cpu/together.py); each test checks its own run."""
    root = tmp_path_factory.mktemp("delta")
    return run_together(lambda enc: _delta_run(root, tiny_model_dir, toy_data_path, enc), ENCODINGS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_delta_pushes_keep_the_engine_on_the_trainers_weights(tiny_model_dir, delta_runs, encoding):
    n = N_ROLLOUT
    tmp_path = result_of(delta_runs, encoding)
    tb, push, local, save = tmp_path / "tb", tmp_path / "push", tmp_path / "local", tmp_path / "ckpt"

    diffs = read_scalars(str(tb), "train/train_rollout_logprob_abs_diff")
    assert sorted(diffs) == list(range(n)) and max(diffs.values()) < 1e-3, diffs  # every push reached the engine

    versions = sorted(os.listdir(push))
    manifests = [json.loads((push / v / MANIFEST).read_text()) for v in versions]
    assert [m["kind"] for m in manifests] == ["full"] + ["delta"] * (len(versions) - 1), versions
    assert len(versions) >= n  # the initial push, then one per trained rollout (the last may be skipped)
    for prev, m in zip(manifests, manifests[1:]):
        assert m["base_id"] == prev["push_id"]

    # rebuild every pushed version from the baseline and the deltas; a listed tensor really differs
    state = _shards(push / versions[0])
    baseline_bytes = _shard_bytes(push / versions[0])
    rebuilt = {versions[0]: dict(state)}
    for v, m in zip(versions[1:], manifests[1:]):
        delta = _shards(push / v)
        assert sorted(delta) == sorted(m["tensors"])  # the folder holds the listed tensors and nothing else
        if encoding == "xor":  # the changed tensors' size at most; overwrite grows with the changed bytes
            assert _shard_bytes(push / v) <= baseline_bytes
        for name in m["tensors"]:
            old = state[name].reshape(-1).view(torch.uint8)
            new = decode(delta[name], old, encoding).view(state[name].dtype).reshape(state[name].shape)
            assert not torch.equal(new, state[name]), f"{v}: {name} listed but unchanged"
            state[name] = new
        rebuilt[v] = dict(state)

    # the trainer's own checkpoint after rollout k is push k+2 (push 1 is the initial one): the tensors whose
    # values differ between two consecutive checkpoints are exactly those the delta lists, with the saved values
    saved = {k: _shards(save / f"iter_{k:07d}") for k in range(n)}
    previous = _shards(tiny_model_dir)
    for k in range(n):
        v = f"weight_v{k + 2:06d}"
        if v not in rebuilt:
            continue
        m = manifests[versions.index(v)]
        common = sorted(set(saved[k]) & set(rebuilt[v]))
        assert common, (sorted(saved[k])[:5], sorted(rebuilt[v])[:5])
        changed = {name for name in common if not torch.equal(saved[k][name], previous[name])}
        assert changed == set(m["tensors"]) & set(common), (v, sorted(changed ^ set(m["tensors"])))
        for name in common:
            assert torch.equal(rebuilt[v][name], saved[k][name]), (v, name)
        previous = saved[k]
    held = _shards(local)
    last = rebuilt[versions[-1]]
    assert sorted(held) == sorted(last) and all(torch.equal(held[name], last[name]) for name in held)
