"""The resident 4B colocated job is refused by `--dry-run` on the GPU node (no GPU time: nothing starts).

benchmarks/colocate_memory.py's job (Qwen3-4B shape, Megatron + SGLang at `--sglang-mem-fraction-static 0.6`,
32 prompts × 8 samples × 1024 tokens, micro-batches of 4) fits one GPU only with the memory handoff: resident
(`--no-offload-rollout --no-offload-train`) the plan counts ~161 GB while training and ~144 GB while generating on
an H200's ~140 GiB. A run that cannot fit should be refused before anything starts, naming the fix, rather than
run out of memory minutes later; this runs the plan of exactly the command the benchmark runs, with the device's
own memory, and expects that refusal.

(The `hf` engine's resident job is refused too, its KV slots counted from the measured prompts: row 11 of
tools/gpu_acceptance.py runs `colocate_memory.py --rollouts hf --modes resident`, which needs the model's tokenizer.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import colocate_memory  # noqa: E402 (benchmarks/ on the path first)
import grpo_step  # noqa: E402
from weight_sync import SHAPES  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the plan of the GPU node)")

# the job of `colocate_memory.py --rollouts sglang --modes resident --steps 3` (its defaults otherwise)
JOB = argparse.Namespace(shape="qwen3-4b", prompts=32, prompt_len=64, response_len=1024, steps=3, micro_batch_size=4,
                         sglang_mem_fraction=0.6, sglang_attention_backend="triton")


def config_only_model(path: str, shape: str) -> str:
    """The shape's config.json alone: all the plan reads (no weights are written)."""
    from transformers import Qwen3Config

    Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                torch_dtype="bfloat16").save_pretrained(path)
    return path


@pytest.mark.timeout(300)
def test_resident_4b_sglang_job_is_refused_by_the_plan(tmp_path):
    model = config_only_model(str(tmp_path / "qwen3-4b"), JOB.shape)
    data = grpo_step.write_prompts(str(tmp_path / "prompts.jsonl"), JOB.prompts, JOB.prompt_len,
                                   SHAPES[JOB.shape]["vocab_size"])
    gib = torch.cuda.mem_get_info()[1] / 2**30
    cmd = [*grpo_step.slime_command(JOB, model, data, str(tmp_path / "tb"), "megatron", "sglang"),
           *colocate_memory.MODES["resident"], "--dry-run", "--dry-run-gpu-gb", f"{gib:.1f}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=240)
    said = done.stdout + done.stderr
    lines = [line.strip() for line in said.splitlines() if "GB" in line and ("!" in line or "error" in line)]
    print(f"\n[plan, resident 4B + sglang, {gib:.1f} GiB] exit {done.returncode}: " + " / ".join(lines)[:600])
    assert "Traceback" not in said, said[-3000:]
    assert done.returncode != 0, (
        "the plan of the resident 4B job only warned (exit 0); it should refuse a run that does not fit:\n"
        + "\n".join(lines))
    assert "--no-offload-rollout" in said or "--no-offload-train" in said, said[-2000:]  # the fix is named
