"""`--check-weight-update-equal` against a real SGLang server on one GPU (run on the H200).

SGLang 0.5.16 serves `POST /weights_checker` (sglang/srt/utils/weight_checker.py: `snapshot` copies every
parameter and buffer to the host, `reset_tensors` overwrites them with random values, `compare` fails naming each
tensor that is not bit-equal to its snapshot). With the flag, `train.py` snapshots and resets the engine once it is
up, so the trainer's first push must restore every tensor SGLang holds, converted losslessly (Megatron: its
layout back to HF names, fused QKV and gate/up split; FSDP: the checkpoint's names, a MoE's fused experts split per
expert); the run fails otherwise. The
job is tests/gpu/test_sglang_train.py's (colocated with the memory handoff: the snapshot is taken before the
engine first releases its memory, the compare after the push that follows its resume), three rollouts; the checks
after the compare are that test's (versions, engine/trainer log-probs) and the policy's move away from the start.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.gpu.sglang_runs import NO_CUDA_GRAPH, check_policy_moved, check_pushes, flag_value
from tests.gpu.test_sglang_train import run_train, sglang_startable, train_cmd

NUM_ROLLOUT = 3

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not sglang_startable(), reason="needs sglang importable, or SLIME_SGLANG_LAUNCHER"),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend, arch, kernel", [
    ("megatron", "qwen3", "torch"), ("fsdp", "qwen3", "torch"), ("fsdp", "qwen3_moe", "torch"),
    ("megatron", "qwen3", "triton"), ("fsdp", "qwen3", "triton"),
])  # fmt: skip
def test_first_push_restores_every_sglang_tensor(backend, arch, kernel, tiny_model_dir, toy_data_path, tmp_path):
    """qwen3_moe: the fsdp trainer holds the experts fused (transformers 5) and pushes them split into the
    checkpoint's per-expert tensors, the only names SGLang's Qwen3-MoE loader takes (checkpoint_format.py).
    triton: the whole job with `--log-probs-kernel triton` (acceptance row 28), so the engine/trainer log-prob
    agreement is read with the Triton kernels beside row 7's with the torch form."""
    if backend == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("needs megatron-core")
    from tools.make_tiny_model import make_tiny_model

    out = str(tmp_path)
    tb = os.path.join(out, "tb")
    # the MoE at "small" (head_dim 64): SGLang 0.5.16's Qwen3-MoE writes the KV cache inside its rotary kernel, which
    # it has only for head_dim 64 / 128 / 256 / 512, and asserts at start-up for the tiny size's 32 (seen on an H100)
    model = tiny_model_dir if arch == "qwen3" else make_tiny_model(os.path.join(out, arch), arch=arch, size="small")
    cmd = flag_value(train_cmd(backend, model, toy_data_path, tb), "--num-rollout", str(NUM_ROLLOUT))
    done, _ = run_train([*cmd, *NO_CUDA_GRAPH, "--check-weight-update-equal", "--log-probs-kernel", kernel], out)
    log = done.stdout + done.stderr
    assert "engine weights snapshotted and reset" in log, log[-3000:]
    assert "every engine holds exactly the pushed weights" in log, log[-3000:]
    name = ", ".join([backend] + [arch] * (arch != "qwen3") + [kernel] * (kernel != "torch"))
    print(f"\n[weights checker, {name}] SGLang's /weights_checker compare passed after the first push")
    check_pushes(tb, f"weights checker, {name}", NUM_ROLLOUT)
    check_policy_moved(tb, f"weights checker, {name}")
