"""--dry-run on benchmarks/colocate_memory.py's job (Qwen3-4B shape, Megatron, colocated on one 141 GB GPU, 32 prompts
× 8 samples × 1024 tokens): the command line is the one the benchmark builds (`grpo_step.slime_command` + its
`MODES`), its model folder (config.json + the word-level tokenizer) and prompts (64 tokens each) as the benchmark
writes them. Without the memory handoff the job needed more than the H200 has (measured: its `hf` engine ran out
of memory at ~150 GB of device use); the plan must refuse it, naming the numbers and the fixes, and pass the same
job with the handoff. The hf engine's KV slots are checked against slots.py's own growth rule."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from slime.backends.hf_engine.slots import bucket_columns
from slime.config.arguments import check_before_start, parse_args
from slime.config.plan import check_memory_fits, format_plan
from slime.config.plan.memory import GiB, hf_slot_cache
from tests.conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from colocate_memory import MODES  # noqa: E402 (benchmarks/ on the path first)
from grpo_step import slime_command, write_prompts  # noqa: E402
from weight_sync import SHAPES, _write_tokenizer  # noqa: E402

H200_GB = "141"
KV_PER_TOKEN = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads, head_dim 128, bf16


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """benchmarks/colocate_memory.py's inputs: the 4B shape's config.json and tokenizer, 32 prompts of 64 tokens."""
    from transformers import Qwen3Config

    root = tmp_path_factory.mktemp("colocate_4b")
    model = str(root / "qwen3-4b")
    Qwen3Config(**SHAPES["qwen3-4b"], max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                torch_dtype="bfloat16").save_pretrained(model)
    _write_tokenizer(model, SHAPES["qwen3-4b"]["vocab_size"])
    data = write_prompts(str(root / "prompts.jsonl"), 32, 64, SHAPES["qwen3-4b"]["vocab_size"])
    return model, data, str(root / "tb")


def argv(job, rollout: str, mode: str) -> list[str]:
    """The train.py flags colocate_memory.py runs for `rollout` and `mode`, with its defaults."""
    model, data, tb = job
    bench = argparse.Namespace(prompts=32, prompt_len=64, response_len=1024, steps=3, micro_batch_size=4,
                               shape="qwen3-4b", sglang_mem_fraction=0.6, sglang_attention_backend="triton")
    cmd = slime_command(bench, model, data, tb, "megatron", rollout) + MODES[mode]
    assert os.path.basename(cmd[1]) == "train.py"
    return cmd[2:] + ["--dry-run", "--dry-run-cuda", "--dry-run-gpu-gb", H200_GB]


def test_slot_estimate_follows_the_engines_growth_rule():
    """64-token prompts, 1024-token responses: the first prefill takes 128 columns, then 256, 512, 1024 and, for the
    last tokens (1087 columns), 2048; the 1024-column buffer is still there while the 2048 one is filled."""
    slots = hf_slot_cache(256, 256, 64, 64 + 1024, KV_PER_TOKEN)
    assert (slots.rows, slots.columns, slots.previous) == (256, 2048, 1024)
    assert slots.peak == 256 * (2048 + 1024) * KV_PER_TOKEN == 108 * GiB
    assert bucket_columns(64 + 1024 - 1) > 1024  # why the last growth happens at all
    one_token_prompt = hf_slot_cache(256, 256, 1, 1 + 1024, KV_PER_TOKEN)
    assert (one_token_prompt.columns, one_token_prompt.previous) == (1024, 512)  # fits before the next doubling
    assert hf_slot_cache(300, 64, 64, 1088, KV_PER_TOKEN).rows == 64  # at most the engine's running batch


def test_the_resident_hf_job_is_refused_with_the_numbers_and_the_fix(job, capsys):
    import train

    with pytest.raises(SystemExit) as info:
        train.main(argv(job, "hf", "resident"))
    message = str(info.value.code)
    assert message.startswith("error: the memory plan refuses this run: ")
    # the engine: 7.5 GB of bf16 weights + 108 GB of KV slots while they grow to 2048 columns
    assert ("colocated, while generating: engines weights + KV slots 115.5 GB + training state 67.4 GB = 182.9 GB > "
            "141.0 GB per GPU: drop --no-offload-train, or lower --sglang-server-concurrency") in message
    assert ("colocated, while training: training 89.5 GB + engines weights + KV slots 115.5 GB = 205.0 GB > 141.0 GB "
            "per GPU: drop --no-offload-rollout") in message
    assert "--skip-memory-check starts the run anyway" in message
    plan = capsys.readouterr().out
    assert "max sample length     1088 = --rollout-max-response-len 1024 + the longest prompt" in plan
    assert "KV slots, growing      108.0 GB = 256 rows × (2048 + 1024) columns × 144.0 KB" in plan
    assert "== Refused ==" in plan and "the plan refuses the run" in plan


def test_the_same_job_with_the_handoff_passes(job, capsys):
    import train

    train.main(argv(job, "hf", "handoff"))  # returns: exit 0
    plan = capsys.readouterr().out
    assert "arguments are valid; nothing was started" in plan and "== Refused ==" not in plan
    assert "colocated, generating       115.5 GB = engines weights + KV slots 115.5 GB + training state in host" in plan
    assert "colocated, training         89.5 GB = training 89.5 GB + engines released (--offload-rollout)" in plan


def test_the_sglang_rows_of_the_benchmark_follow_the_same_rule(job):
    """benchmarks/README.md recorded this plan as warnings (training 162.2 GB, generating 144.5 GB of 141): now a
    refusal naming the static pool that would fit; with the handoff it passes."""
    from slime.config.arguments import SlimeArgumentError
    from slime.config.plan import print_plan

    resident = parse_args(argv(job, "sglang", "resident"))
    with pytest.raises(SlimeArgumentError) as info:
        print_plan(resident, file=open(os.devnull, "w"))
    assert "training 89.5 GB + engines static pool 84.6 GB = 174.1 GB > 141.0 GB" in str(info.value)
    assert "engines static pool 84.6 GB + training state 67.4 GB = 152.0 GB > 141.0 GB" in str(info.value)
    assert "lower --sglang-mem-fraction-static to 0.35" in str(info.value)
    print_plan(parse_args(argv(job, "sglang", "handoff")), file=open(os.devnull, "w"))


def test_skip_memory_check_turns_the_refusal_into_a_warning(job):
    args = parse_args(argv(job, "hf", "resident") + ["--skip-memory-check"])
    plan = format_plan(args)
    assert "== Refused ==" not in plan
    assert "(not refused: --skip-memory-check)" in plan and "205.0 GB > 141.0 GB" in plan


def test_train_py_refuses_it_before_ray_starts_on_the_gpu_it_runs_on(job, monkeypatch):
    """Without --dry-run, check_before_start measures the local GPU (here: an H200's 139.8 GiB, as torch reports
    it) and refuses the same job; with no GPU on the driver it cannot tell and lets the run start."""
    args = parse_args(argv(job, "hf", "resident"))
    args.dry_run = False  # the GPU run as train.py checks it, with the plan's GPU view of the flags
    from slime.config.arguments import SlimeArgumentError

    with pytest.raises(SlimeArgumentError, match=r"182\.9 GB > 139\.8 GB per GPU: drop --no-offload-train"):
        check_memory_fits(args, 150_117_892_096)  # torch.cuda.get_device_properties(0).total_memory of an H200
    monkeypatch.setattr("slime.config.arguments._local_gpu_bytes", lambda: 150_117_892_096)
    with pytest.raises(SlimeArgumentError, match="the memory plan refuses this run"):
        check_before_start(args)
    monkeypatch.setattr("slime.config.arguments._local_gpu_bytes", lambda: None)
    check_before_start(args)  # no GPU on the driver: nothing to check against
    monkeypatch.setattr("slime.config.arguments._local_gpu_bytes", lambda: 150_117_892_096)
    args.skip_memory_check = True
    check_before_start(args)
