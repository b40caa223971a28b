"""`--optimizer-cpu-offload` (Megatron) with real SGLang on one GPU (run on the H200).

megatron-core's `HybridDeviceOptimizer` keeps the fp32 master weights and Adam state on the host
(`--optimizer-offload-fraction` 1.0, the default) and updates them there; on megatron-core's precision-aware path
(`--use-precision-aware-optimizer`, which the flag needs) its parameters are views of the DDP chunks' bf16
parameter buffer, and each step's host result is copied back into them. The job is
tests/gpu/test_sglang_train.py's (Megatron trainer, one SGLang engine colocated), in two forms:

- `handoff`: `--colocate`'s defaults, so `--offload-train` moves the training state off the GPU around every
  generation while the optimizer's own state already lives on the host (what users run);
- `resident`: `--no-offload-train`, the optimizer offload alone.

Checked from the TensorBoard: the pushes reached SGLang (versions, engine/trainer log-probs within bf16 error)
and the policy moved away from its initial weights (`train/kl_loss` > 0): an optimizer whose steps land in a copy
of the parameters passes the first two checks and fails this one.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slime.utils.tracking import read_scalars
from tests.gpu.sglang_runs import NO_CUDA_GRAPH, check_policy_moved, check_pushes
from tests.gpu.test_sglang_train import NUM_ROLLOUT, run_train, sglang_startable, train_cmd

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not sglang_startable(), reason="needs sglang importable, or SLIME_SGLANG_LAUNCHER"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
FORMS = {"handoff": [], "resident": ["--no-offload-train"]}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("form", list(FORMS))
def test_optimizer_cpu_offload_trains_and_pushes(form, tiny_model_dir, toy_data_path, tmp_path):
    out = str(tmp_path)
    tb = os.path.join(out, "tb")
    name = f"optimizer cpu offload, {form}"
    cmd = [*train_cmd("megatron", tiny_model_dir, toy_data_path, tb), *NO_CUDA_GRAPH, *OFFLOAD, *FORMS[form]]
    run_train(cmd, out)
    check_pushes(tb, name, NUM_ROLLOUT)
    moved = read_scalars(tb, "perf/actor_offload_moved_gb")
    on = read_scalars(tb, "perf/actor_onload_allocated_gb")
    print(f"[{name}] actor GB moved at offload {[round(v, 3) for _, v in sorted(moved.items())]}; allocated while "
          f"training {[round(v, 3) for _, v in sorted(on.items())]}")
    if form == "handoff":  # the trainer's state went to the host and back around every generation
        assert sorted(moved) == list(range(NUM_ROLLOUT)) and min(moved.values()) > 0, moved
    else:
        assert not moved, moved
    check_policy_moved(tb, name)
