"""SFT with images through train.py (docs/sft.md): slime's SFT flags with --multimodal-keys on the tiny Qwen2.5-VL
and the colour task as supervised rows (tools/make_toy_data.py --task colour_sft), no engine. With the fsdp trainer
the loss falls from ~5.3 to below ln(3)/2 on rows not seen before: each row trains 2 tokens (the colour and
<|im_end|>), and a model that does not read the image cannot beat the colours' entropy, ln 3, on the first. The
Megatron trainer (the test-only CPU shim) trains the same rows to the same losses. Every process is reaped."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest

from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT, model_args
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.test_train_e2e import _env

SHIM_SITE = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "plugins", "megatron_shim")
ROLLOUTS, BATCH = 12, 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model
    from tools.make_toy_data import write_toy_data

    root = tmp_path_factory.mktemp("sft_images")
    model = make_tiny_model(str(root / "vlm"), arch="qwen2_5_vl", size="tiny", seed=0)
    # more rows than the run takes: every step trains on rows it has not seen
    data = write_toy_data(str(root / "colour_sft.jsonl"), ROLLOUTS * BATCH + 8, seed=0, task="colour_sft")
    return model, data


def sft(model: str, data: str, tb: str, *extra: str, env: dict | None = None) -> dict[int, float]:
    before = run_processes()
    out = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "train.py"), "--actor-num-nodes", "1",
         "--actor-num-gpus-per-node", "1", "--hf-checkpoint", model,
         "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--prompt-data", data,
         "--input-key", "messages", "--multimodal-keys", '{"image": "images"}', "--rollout-shuffle",
         "--num-rollout", str(ROLLOUTS), "--rollout-batch-size", str(BATCH), "--global-batch-size", str(BATCH),
         "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
         "--debug-train-only", "--optimizer", "adam", "--lr", "3e-3", "--lr-decay-style", "constant",
         "--use-tensorboard", "--tensorboard-dir", tb, *extra],
        capture_output=True, text=True, env=env or _env(), timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert wait_for_no_new_processes(before) == {}
    losses = read_scalars(tb, "train/loss")
    print("train/loss", {k: round(v, 4) for k, v in losses.items()})
    assert sorted(losses) == list(range(ROLLOUTS))
    return losses


@pytest.fixture(scope="module")
def fsdp_losses(setup, tmp_path_factory):
    model, data = setup
    return sft(model, data, str(tmp_path_factory.mktemp("tb_fsdp")))


@pytest.mark.timeout(450)
def test_fsdp_sft_with_images_learns_to_read_the_image(fsdp_losses):
    first, last = fsdp_losses[0], fsdp_losses[ROLLOUTS - 1]
    assert first > 4.0, fsdp_losses  # about ln of the 192-token vocabulary at the start
    assert last < math.log(3) / 2 < first, fsdp_losses  # seen: 5.28 -> 0.32


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
@pytest.mark.timeout(500)
def test_megatron_sft_with_images_trains_as_fsdp(setup, fsdp_losses, tmp_path):
    model, data = setup
    env = dict(_env(), PYTHONPATH=os.pathsep.join([SHIM_SITE, REPO_ROOT]))
    losses = sft(model, data, str(tmp_path / "tb"), "--train-backend", "megatron", *model_args("tiny-qwen2.5-vl"),
                 "--micro-batch-size", "8", env=env)
    for k in range(ROLLOUTS):  # seen: within 0.2%
        assert losses[k] == pytest.approx(fsdp_losses[k], rel=1e-2), (k, losses, fsdp_losses)
