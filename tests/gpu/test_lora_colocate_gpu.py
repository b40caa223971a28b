"""LoRA colocated on one GPU (run on the H200): the Megatron trainer and a real SGLang server take turns with the
memory (the `--colocate` handoff), and every push sends only the adapter (GPU acceptance row 22, docs/lora.md).

The job is benchmarks/colocate_memory.py's, short: a random-init model of Qwen3-4B's published shape
(benchmarks/weight_sync.py), 4 prompts x 8 samples x 128 tokens, bf16, the distributed optimizer, 3 rollouts, run
by the benchmark's own `run_mode` (its memory per phase and per trainer move). Two runs:

- LoRA: `--lora-rank 16 --lora-alpha 32 --target-modules all-linear` (Megatron's local layers), lr 2e-4, KL to
  the base. SGLang is started with `--enable-lora` and `--enable-weights-cpu-backup`: a release pauses its weights
  into host memory and a resume brings the base back, then the adapter push loads the new adapter;
- full weights (`test_full_weight_push_of_the_same_job`, row 24: one device call does not hold both runs): the same
  job without LoRA (the same KL term, so a reference model of its own), one rollout, for the step, the push seconds
  and bytes of the full model.

Printed: step seconds, memory per phase (the benchmark's tables), push seconds (`perf/update_weights_time`, the
push after each step) and bytes (from the shapes: `adapter_bytes`) of the adapter against the full weights, the
trainer/engine log-prob gap per rollout and the KL to the base.
Asserted: every step ran, SGLang was started with both flags, the gap is within bf16 error (< 0.05, the other
SGLang rows' bound; measured ~1e-3 there) after every adapter push, the policy moved (KL > 0), and the adapter push
sends < 2% of the full weights' bytes.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.gpu.test_sglang_train import sglang_startable

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not sglang_startable(), reason="needs sglang importable, or SLIME_SGLANG_LAUNCHER"),
]
BENCH_DIR = os.path.join(REPO_ROOT, "benchmarks")
KL = ("--use-kl-loss", "--kl-loss-coef", "0.001")
LORA = ("--lora-rank", "16", "--lora-alpha", "32", "--target-modules", "all-linear", "--transformer-impl", "local",
        "--lr", "2e-4", *KL)


def job_args(steps: int) -> argparse.Namespace:
    """benchmarks/colocate_memory.py's options for the short 4B job (its row 9 sizes)."""
    return argparse.Namespace(shape="qwen3-4b", backend="megatron", prompts=4, prompt_len=64, response_len=128,
                              steps=steps, micro_batch_size=4, sglang_mem_fraction=0.6,
                              sglang_attention_backend="triton", engine_weights_cpu_backup=False, keep_logs="",
                              train_args="")


def checkpoint_bytes(model_dir: str) -> int:
    """What a full push sends: every tensor of the HF checkpoint (bf16; the tied embedding once)."""
    from safetensors import safe_open

    size = {"BF16": 2, "F16": 2, "F32": 4}
    total = 0
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = f.get_slice(name)
                total += math.prod(t.get_shape()) * size[t.get_dtype()]
    return total


def adapter_bytes(model_dir: str, rank: int) -> int:
    """What an adapter push sends for all-linear (slime/weight_sync/adapter.py): per decoder layer and HF linear
    (in, out), A (r x in) and B (out x r) under HF names, in the trainer's bf16 (the trainer's actors log at warning
    level, so the push's own byte count does not reach train.py's output; tests/e2e_cpu/test_lora.py checks on CPU
    that an engine receives exactly these bytes)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    h, q, kv, ffn = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], \
        c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, ffn), (h, ffn), (ffn, h)]  # q k v o gate up down
    return c["num_hidden_layers"] * sum(rank * (i + o) for i, o in shapes) * 2


def scalars(workdir: str, tag: str) -> dict[int, float]:
    from slime.utils.tracking import read_scalars

    return read_scalars(os.path.join(workdir, "sglang_handoff_tb"), tag)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The short 4B job's model folder and prompts, written once for both tests."""
    sys.path.insert(0, BENCH_DIR)
    from grpo_step import job_inputs

    root = str(tmp_path_factory.mktemp("lora_colocate"))
    return job_inputs(job_args(3), root)


@pytest.mark.timeout(900)
def test_lora_colocated_with_sglang_pushes_only_the_adapter(job, tmp_path):
    """Row 22: the LoRA job, 3 rollouts."""
    from colocate_memory import report, run_mode

    model_dir, data = job
    lora = run_mode(job_args(3), "sglang", "handoff", model_dir, data, str(tmp_path), extra_flags=LORA)
    print(report("LoRA r=16 all-linear, sglang, handoff", lora), flush=True)
    with open(os.path.join(tmp_path, "sglang_handoff.log"), errors="replace") as f:
        log = f.read()
    assert lora["rc"] == 0, lora["error"] + "\n" + log[-4000:]
    engine_log = "".join(open(p, errors="replace").read()
                         for p in glob.glob(os.path.join(tmp_path, "sglang_handoff_engine_logs", "*.log")))
    assert "--enable-weights-cpu-backup" in engine_log and "--enable-lora" in engine_log, engine_log[:3000]

    diffs = scalars(str(tmp_path), "train/train_rollout_logprob_abs_diff")
    kl = scalars(str(tmp_path), "train/kl_loss")
    push_s = scalars(str(tmp_path), "perf/update_weights_time")
    steps = scalars(str(tmp_path), "perf/step_time")
    adapter, full_bytes = adapter_bytes(model_dir, int(LORA[1])), checkpoint_bytes(model_dir)
    print(f"[lora colocate] step s {[round(v, 2) for _, v in sorted(steps.items())]}; engine/trainer |Δ log-prob| "
          f"{[f'{diffs[k]:.2e}' for k in sorted(diffs)]}; kl_loss {[f'{kl[k]:.2e}' for k in sorted(kl)]}", flush=True)
    print(f"[lora colocate] push s adapter {[round(v, 3) for _, v in sorted(push_s.items())]}; push bytes adapter "
          f"{adapter / 1e6:.1f} MB vs full {full_bytes / 1e9:.2f} GB ({adapter / full_bytes:.2%})", flush=True)
    assert sorted(steps) == [0, 1, 2], steps
    assert sorted(push_s) == [0, 1, 2], push_s
    assert sorted(diffs) == [0, 1, 2] and max(diffs.values()) < 0.05, diffs  # bf16 SGLang vs bf16 trainer
    assert max(abs(v) for k, v in kl.items() if k > 0) > 0, kl  # the adapter moved the policy off the base
    assert adapter < 0.02 * full_bytes, (adapter, full_bytes)


@pytest.mark.timeout(900)
def test_full_weight_push_of_the_same_job(job, tmp_path):
    """Row 24: the same job without LoRA, one rollout: the full-weight push's seconds and bytes to set against
    row 22's adapter push (one device call cannot hold both runs)."""
    from colocate_memory import report, run_mode

    model_dir, data = job
    full = run_mode(job_args(1), "sglang", "handoff", model_dir, data, str(tmp_path), extra_flags=KL)
    print(report("full weights, sglang, handoff", full), flush=True)
    assert full["rc"] == 0, full["error"]
    push_s = scalars(str(tmp_path), "perf/update_weights_time")
    steps = scalars(str(tmp_path), "perf/step_time")
    diffs = scalars(str(tmp_path), "train/train_rollout_logprob_abs_diff")
    print(f"[full push] step s {[round(v, 2) for _, v in sorted(steps.items())]}; push s "
          f"{[round(v, 3) for _, v in sorted(push_s.items())]}; push bytes {checkpoint_bytes(model_dir) / 1e9:.2f} GB; "
          f"engine/trainer |Δ log-prob| {[f'{diffs[k]:.2e}' for k in sorted(diffs)]}", flush=True)
    assert sorted(push_s) == [0], push_s
    assert sorted(diffs) == [0] and diffs[0] < 0.05, diffs  # row 22's base gap, without adapters
