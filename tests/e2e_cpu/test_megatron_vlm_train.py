"""train.py on the visual toy task (docs/vlm.md) with the Megatron trainer: the tiny Qwen2.5-VL and the tiny
Qwen3-VL (language model on megatron-core through the test-only CPU shim, installed in the run's processes by
tests/e2e_cpu/plugins/megatron_shim/sitecustomize.py; the HF vision tower) through real Ray, sglang-router and one
hf engine given image_data. Each rollout after the first is sampled with the weights the trainer pushed after the
previous step (the engine takes the push's Hub names), and the trainer's log-probs of the sampled tokens equal the
engine's (the images and the pushed weights reached both); every process is reaped. The same for
Qwen2.5-VL with LoRA (docs/lora.md "Vision-language models"): the pushes are adapters, which the engine merges."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT, model_args
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")

SHIM_SITE = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "plugins", "megatron_shim")
ROLLOUTS = 3
SCRIPTS = {"qwen2_5_vl": "tiny-qwen2.5-vl", "qwen3_vl": "tiny-qwen3-vl"}  # the tiny VLM -> its MODEL_ARGS


# LoRA on the decoder's linears (the vision tower frozen, without adapters): each push is an adapter named as the
# Qwen2.5-VL checkpoint names its modules (model.layers.*), which the hf engine maps to transformers' names
LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear", "--transformer-impl", "local"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch, extra", [pytest.param(arch, [], id=arch) for arch in SCRIPTS]
                         + [pytest.param("qwen2_5_vl", LORA, id="qwen2_5_vl-lora")])
def test_megatron_trains_the_tiny_vlm_through_train_py(tmp_path, arch, extra):
    from tools.make_tiny_model import make_tiny_model
    from tools.make_toy_data import write_toy_data

    model = make_tiny_model(str(tmp_path / "vlm"), arch=arch, size="tiny", seed=0)
    data = write_toy_data(str(tmp_path / "colour.jsonl"), 64, seed=0, task="colour")
    tb = tmp_path / "tb"
    env = dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (SHIM_SITE, REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    before = run_processes()
    out = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "train.py"), "--train-backend", "megatron",
         *model_args(SCRIPTS[arch]), "--rollout-backend", "hf",
         "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
         "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
         "--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--rm-type", "toy",
         "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
         "--rollout-max-response-len", "3", "--num-rollout", str(ROLLOUTS), "--lr", "1e-3",
         "--micro-batch-size", "8", "--advantage-estimator", "grpo", "--entropy-coef", "0.01", "--seed", "7",
         "--use-tensorboard", "--tensorboard-dir", str(tb),
         "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt"), *extra],
        capture_output=True, text=True, env=env, timeout=560, cwd=str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]

    versions = {}
    for k in range(ROLLOUTS):
        dump = torch.load(tmp_path / f"rollout_{k}.pt", weights_only=False)
        assert any(s["multimodal_inputs"] for s in dump["samples"]), "the rollout carried no images"
        versions[k] = {v for s in dump["samples"] for v in s["weight_versions"]}
    print("weight versions per rollout", versions)
    # one version per rollout, a new one after every push
    assert all(len(v) == 1 for v in versions.values()), versions
    seen = [next(iter(versions[k])) for k in range(ROLLOUTS)]
    assert len(set(seen)) == ROLLOUTS, seen

    diffs = read_scalars(str(tb), "train/train_rollout_logprob_abs_diff")
    losses = read_scalars(str(tb), "train/loss")
    grad_norms = read_scalars(str(tb), "train/grad_norm")
    print("train_rollout_logprob_abs_diff", diffs, "loss", losses, "grad_norm", grad_norms)
    assert sorted(diffs) == sorted(losses) == list(range(ROLLOUTS))
    assert all(v < 1e-4 for v in diffs.values()), diffs
    assert all(math.isfinite(v) for v in losses.values()), losses
    # the entropy term gives every step a gradient, also when every group's rewards are equal
    assert all(math.isfinite(v) and v > 0 for v in grad_norms.values()), grad_norms
    assert wait_for_no_new_processes(before) == {}
