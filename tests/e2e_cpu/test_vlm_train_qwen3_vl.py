"""train.py on the visual toy task with the tiny Qwen3-VL (deepstack features, interleaved 3-D RoPE, patch 16):
real Ray, sglang-router, one hf engine given image_data and one fsdp rank given the images, 3 rollouts. The
trainer's log-probs of every rollout equal the engine's (the images, their positions and deepstack features reached
both), the losses are finite, each rollout is sampled with the weights pushed after the previous step,
`--rollout-max-prompt-len` counts the image tokens (the prompts whose image has 4 tokens are dropped, those with 2
kept), and every process is reaped."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import torch

from slime.utils.processing_utils import load_processor, open_image
from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.test_vlm_train import colour_train_cmd

NUM_ROLLOUT = 3
QUESTION = "which colour fills the image?"


def image_tokens_per_row(processor, data: str) -> list[int]:
    counts = []
    with open(data) as f:
        for line in f:
            image = open_image(json.loads(line)["images"][0]).convert("RGB")
            grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
            counts.append(int(grid.prod()) // processor.image_processor.merge_size ** 2)
    return counts


@pytest.mark.timeout(400)
def test_three_rollouts_with_images_on_qwen3_vl(tmp_path):
    from tools.make_tiny_model import make_tiny_model
    from tools.make_toy_data import write_toy_data

    model = make_tiny_model(str(tmp_path / "vlm"), arch="qwen3_vl", size="tiny", seed=0)
    data = write_toy_data(str(tmp_path / "colour.jsonl"), 64, seed=0, task="colour")
    processor = load_processor(model, trust_remote_code=True)
    counts = image_tokens_per_row(processor, data)
    assert sorted(set(counts)) == [2, 4], counts  # the task's images: 2 or 4 image tokens on this model
    # the chat prompt with one placeholder: a 2-token image expands it to one more token, a 4-token image to 3 more
    content = [{"type": "image", "image": "x"}, {"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    max_prompt_len = len(processor.tokenizer(text)["input_ids"]) + 1
    tb = tmp_path / "tb"
    env = dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO_ROOT)
    before = run_processes()
    # the random policy rarely names a colour, so GRPO's advantages are mostly 0: the entropy term gives every step a
    # gradient
    out = subprocess.run(
        colour_train_cmd(model, data, tmp_path, NUM_ROLLOUT, "--rollout-max-prompt-len", str(max_prompt_len),
                         "--advantage-estimator", "grpo", "--entropy-coef", "0.01"),
        capture_output=True, text=True, env=env, timeout=360, cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert wait_for_no_new_processes(before) == {}
    steps = list(range(NUM_ROLLOUT))
    diffs = read_scalars(str(tb), "train/train_rollout_logprob_abs_diff")
    assert sorted(diffs) == steps and all(v < 1e-5 for v in diffs.values()), diffs
    losses = read_scalars(str(tb), "train/loss")
    assert sorted(losses) == steps and all(math.isfinite(v) for v in losses.values()), losses
    grad_norms = read_scalars(str(tb), "train/grad_norm")
    assert all(math.isfinite(v) and v > 0 for v in grad_norms.values()), grad_norms
    print(f"\n[qwen3-vl train] |trainer - engine| log-prob {diffs}, loss {losses}, grad norm {grad_norms}")
    image_token = processor.image_token_id
    versions = []
    for step in steps:
        samples = torch.load(tmp_path / "dump" / f"rollout_{step}.pt", weights_only=False)["samples"]
        assert len(samples) == 16
        for s in samples:
            prompt = s["tokens"][: len(s["tokens"]) - s["response_length"]]
            assert len(prompt) <= max_prompt_len
            versions.append((step, *s["weight_versions"]))
            grid = s["multimodal_train_inputs"]["image_grid_thw"].tolist()
            # the prompt's image expanded to its tokens; only 2-token images passed the length limit
            assert prompt.count(image_token) == sum(t * h * w for t, h, w in grid) // 4 == 2, (prompt, grid)
    # each rollout sampled with one weight version, newer than the previous rollout's (the push after each step)
    per_step = [sorted({int(v) for st, *vs in versions if st == step for v in vs}) for step in steps]
    assert all(len(v) == 1 for v in per_step) and [v[0] for v in per_step] == sorted({v[0] for v in per_step}), per_step
