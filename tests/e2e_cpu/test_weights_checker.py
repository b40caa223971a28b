"""POST /weights_checker on a real hf engine server: what --check-weight-update-equal runs around the first push."""

import os
import subprocess
import sys

import httpx
import pytest
import torch

from slime.backends.hf_engine.engine import HFEngine
from slime.backends.server_engine import EngineHTTPError
from slime.weight_sync.tensor_payload import flatten_bucket, serialize_bucket
from tests.args import make_args
from tests.conftest import REPO_ROOT

SEQ = [56, 62, 137, 92, 138, 20, 21, 22]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = HFEngine(make_args(hf_checkpoint=tiny_model_dir, rollout_seed=1), rank=0)
    try:
        eng.init()
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir):
    """The trainer's side of a push: the checkpoint's parameters by name (tied ones once, as named_parameters)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def push(engine, named, version):
    flat = flatten_bucket(named)  # kept alive until the engine has copied it
    engine.update_weights_from_tensor(serialize_bucket(flat), weight_version=version)


def scores(url):
    out = httpx.post(url + "/generate", json={"input_ids": SEQ, "sampling_params": {"max_new_tokens": 0},
                                             "return_logprob": True, "logprob_start_len": 0}, timeout=60).json()
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]


@pytest.mark.timeout(180)
def test_complete_push_passes_and_a_missing_tensor_is_named(engine, checkpoint):
    url = engine.get_url()
    with pytest.raises(EngineHTTPError, match="snapshot first"):
        engine.check_weights("compare")
    bad = httpx.post(url + "/weights_checker", json={"action": "bogus"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["success"] is False and "bogus" in bad.json()["message"]

    loaded = scores(url)
    checksum = httpx.post(url + "/weights_checker", timeout=30).json()  # no body: SGLang's default, "checksum"
    assert checksum["success"] is True and checksum["per_engine_checksum"]
    assert engine.check_weights("snapshot") == {"success": True, "message": "Success."}
    engine.check_weights("reset_tensors")
    assert max(abs(a - b) for a, b in zip(scores(url), loaded)) > 0.1  # the engine no longer holds the checkpoint

    push(engine, checkpoint, "1")
    assert engine.check_weights("compare")["success"] is True
    assert scores(url) == loaded
    assert engine.check_weights("checksum")["per_engine_checksum"] == checksum["per_engine_checksum"]

    engine.check_weights("reset_tensors")
    left_out = next(n for n, _ in checkpoint if n.endswith("mlp.down_proj.weight"))
    push(engine, [(n, t) for n, t in checkpoint if n != left_out], "2")
    with pytest.raises(EngineHTTPError) as info:
        engine.check_weights("compare")
    message = str(info.value)
    assert "check tensor equality failed" in message and f"name={left_out} " in message
    assert message.count("name=") == 1  # only the tensor the push left out differs


@pytest.mark.timeout(300)
def test_train_py_with_the_flag_compares_the_first_push(tiny_model_dir, toy_data_path):
    """The whole path: start-up snapshot and reset, the fsdp trainer's first push, the compare."""
    cmd = [sys.executable, os.path.join(REPO_ROOT, "train.py"), "--hf-checkpoint", tiny_model_dir,
           "--prompt-data", toy_data_path, "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
           "--micro-batch-size", "4", "--global-batch-size", "16", "--num-rollout", "1", "--rm-type", "toy",
           "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--check-weight-update-equal"]
    env = dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO_ROOT)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "engine weights snapshotted and reset" in log
    assert "every engine holds exactly the pushed weights" in log
