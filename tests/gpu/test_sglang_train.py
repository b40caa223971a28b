"""`train.py --rollout-backend sglang --colocate` through a real SGLang server on one GPU (run on the H200).

Skipped unless CUDA is there and SGLang can be started: either `sglang` imports in this process, or
`SLIME_SGLANG_LAUNCHER` names a launcher for it (on the H200 SGLang lives in a site folder of its own, since
its transformers pin must not shadow ours: `SLIME_SGLANG_LAUNCHER="env PYTHONPATH=/tmp/sgl-site:/tmp/site
python3 -m sglang.launch_server"`; docs/sglang_backend.md).

Each run trains GRPO on the toy task with the tiny Qwen3 for a few rollouts, the trainer and one SGLang engine
sharing the GPU behind the real sglang-router, weights pushed after every rollout by `update_weights_from_tensor`
(SGLang's flattened-bucket payload over CUDA IPC). Checked from its TensorBoard, per rollout:
- every sample was generated under the version pushed just before (`rollout/weight_version` min == max, +1 per
  rollout): the pushes reached SGLang and it stamped them;
- the engine's log-probs of the sampled tokens equal the trainer's within bf16 error
  (`train/train_rollout_logprob_abs_diff`): what SGLang serves is what was trained;
- the first step's `train/ppo_kl` is 0 (one optimizer step per rollout: old and new policy coincide).
SGLang runs with the triton attention backend and the pytorch sampler (fa3 crashed on the H200, see
docs/sglang_backend.md).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT, model_args

NUM_ROLLOUT = 5
SGLANG_FLAGS = ["--sglang-attention-backend", "triton", "--sglang-sampling-backend", "pytorch",
                "--sglang-dtype", "bfloat16", "--sglang-mem-fraction-static", "0.3",
                "--sglang-cuda-graph-max-bs", "32", "--sglang-disable-prefill-cuda-graph"]  # fmt: skip


def sglang_startable() -> bool:
    return bool(os.environ.get("SLIME_SGLANG_LAUNCHER")) or importlib.util.find_spec("sglang") is not None


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not sglang_startable(), reason="needs sglang importable, or SLIME_SGLANG_LAUNCHER"),
]


def train_cmd(backend: str, model_dir: str, data_path: str, tb: str) -> list[str]:
    arch = model_args("tiny-qwen3") if backend == "megatron" else []
    return [
        sys.executable, os.path.join(REPO_ROOT, "train.py"), *arch,
        "--train-backend", backend, "--rollout-backend", "sglang", "--colocate",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--bf16",
        "--hf-checkpoint", model_dir, "--prompt-data", data_path, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "toy", "--num-rollout", str(NUM_ROLLOUT),
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
        "--micro-batch-size", "32", "--rollout-max-response-len", "4",
        "--lr", "7e-4", "--use-kl-loss", "--kl-loss-coef", "0.001",
        "--use-tensorboard", "--tensorboard-dir", tb, *SGLANG_FLAGS,
    ]  # fmt: skip


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_train_py_colocated_with_real_sglang(backend, tiny_model_dir, toy_data_path, tmp_path):
    if backend == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("needs megatron-core")
    out = str(tmp_path)
    tb = os.path.join(out, "tb")
    logs = os.path.join(out, "engine_logs")
    env = dict(os.environ, SLIME_ENGINE_LOG_DIR=logs,
               PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(train_cmd(backend, tiny_model_dir, toy_data_path, tb), capture_output=True, text=True,
                          env=env, cwd=out, timeout=840)
    engine_log = ""
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), errors="replace") as f:
            text = f.read()
        engine_log += f"--- {name}\n{text[:500]}\n...\n{text[-3000:]}"  # its first line is the command
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:] + engine_log
    assert "sglang.launch_server" in engine_log, "the engine was not a real SGLang server"

    versions = read_scalars(tb, "rollout/weight_version/min")
    newest = read_scalars(tb, "rollout/weight_version/max")
    diffs = read_scalars(tb, "train/train_rollout_logprob_abs_diff")
    ppo_kl = read_scalars(tb, "train/ppo_kl")
    steps = sorted(versions)
    print(f"\n[sglang {backend}] weight version per rollout {[versions[k] for k in steps]}; engine/trainer "
          f"|Δ log-prob| {[f'{diffs[k]:.2e}' for k in sorted(diffs)]}; ppo_kl {[f'{ppo_kl[k]:.1e}' for k in sorted(ppo_kl)]}; "
          f"raw reward {[round(v, 3) for _, v in sorted(read_scalars(tb, 'rollout/raw_reward').items())]}; step s "
          f"{[round(v, 2) for _, v in sorted(read_scalars(tb, 'perf/step_time').items())]}")
    assert steps == list(range(NUM_ROLLOUT))
    stamped = [versions[k] for k in steps]
    assert stamped == [newest[k] for k in steps]  # no rollout mixes versions (synchronous train.py)
    assert all(b - a == 1 for a, b in zip(stamped, stamped[1:])), stamped  # one push per rollout reached SGLang
    assert max(diffs.values()) < 0.05  # bf16 SGLang vs bf16 trainer on the same pushed weights
    assert abs(ppo_kl[min(ppo_kl)]) < 1e-3
