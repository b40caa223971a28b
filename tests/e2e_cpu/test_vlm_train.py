"""train.py on the visual toy task (docs/vlm.md): the tiny Qwen2.5-VL through real Ray, sglang-router, one hf
engine given image_data and one fsdp rank given the images; the trainer's log-probs of the rollouts equal the
engine's (the images reached both), an eval dataset with images (`--eval-prompt-data`, the same
`--multimodal-keys`) is scored before training and after rollout 1 with its prompts' images expanded to image
tokens, and every process is reaped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import torch

from slime.utils.processing_utils import load_processor
from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes


def colour_train_cmd(model: str, data: str, tmp_path, num_rollout: int, *extra: str) -> list[str]:
    """train.py on the colour task: fsdp + one hf engine, 4 prompts x 4 samples, 3-token responses, the rollouts
    dumped to tmp_path/dump and TensorBoard scalars in tmp_path/tb."""
    return [sys.executable, os.path.join(REPO_ROOT, "train.py"), "--train-backend", "fsdp", "--rollout-backend", "hf",
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
            "--hf-checkpoint", model, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
            "--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--rm-type", "toy",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
            "--rollout-max-response-len", "3", "--num-rollout", str(num_rollout), "--lr", "1e-3",
            "--micro-batch-size", "8", "--save-debug-rollout-data", str(tmp_path / "dump" / "rollout_{rollout_id}.pt"),
            "--use-tensorboard", "--tensorboard-dir", str(tmp_path / "tb"), *extra]  # fmt: skip


@pytest.mark.timeout(600)
def test_two_rollouts_with_images(tmp_path):
    from tools.make_tiny_model import make_tiny_model
    from tools.make_toy_data import write_toy_data

    model = make_tiny_model(str(tmp_path / "vlm"), arch="qwen2_5_vl", size="tiny", seed=0)
    data = write_toy_data(str(tmp_path / "colour.jsonl"), 64, seed=0, task="colour")
    eval_data = write_toy_data(str(tmp_path / "colour_eval.jsonl"), 6, seed=1, task="colour")
    tb = tmp_path / "tb"
    env = dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO_ROOT)
    before = run_processes()
    out = subprocess.run(
        colour_train_cmd(model, data, tmp_path, 2, "--eval-prompt-data", "colour", eval_data, "--eval-interval", "2",
                         "--n-samples-per-eval-prompt", "2"),
        capture_output=True, text=True, env=env, timeout=560, cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rewards = read_scalars(str(tb), "rollout/raw_reward")
    assert sorted(rewards) == [0, 1] and all(0.0 <= v <= 1.0 for v in rewards.values()), rewards
    diffs = read_scalars(str(tb), "train/train_rollout_logprob_abs_diff")
    assert sorted(diffs) == [0, 1] and all(v < 1e-5 for v in diffs.values()), diffs
    assert wait_for_no_new_processes(before) == {}
    evals = read_scalars(str(tb), "eval/colour")  # the eval reward, before training and after rollout 1
    assert sorted(evals) == [0, 1] and all(0.0 <= v <= 1.0 for v in evals.values()), evals
    image_token = load_processor(model, trust_remote_code=True).image_token_id
    for step in (0, 1):
        samples = torch.load(tmp_path / "dump" / f"rollout_eval_{step}.pt", weights_only=False)["samples"]
        assert len(samples) == 12
        for s in samples:  # each prompt's image expanded to its tokens (a merged patch each), as in training
            prompt = s["tokens"][: len(s["tokens"]) - s["response_length"]]
            grid = s["multimodal_train_inputs"]["image_grid_thw"].tolist()
            assert prompt.count(image_token) == sum(t * h * w for t, h, w in grid) // 4 > 0, (prompt, grid)
