"""The Megatron backend across GPUs (needs two; run on nvidia-h200-x2): TP2 and PP2 over NCCL against one
GPU, in fp32, on the same tiny Qwen3 and batch as the CPU-shim tests (tests/e2e_cpu/test_megatron_actor.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.e2e_cpu.ranks import run_ranks
from tests.e2e_cpu.test_megatron_actor import WORKER, max_abs_diff

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_gpu")
    model = ["--model", tiny_model_dir]
    return {
        "one": run_ranks(WORKER, 1, str(root / "one"), model, timeout_s=300),
        "tp2": run_ranks(WORKER, 2, str(root / "tp2"), model + ["--tp", "2"], timeout_s=300),
        "pp2": run_ranks(WORKER, 2, str(root / "pp2"), model + ["--pp", "2"], timeout_s=300),
    }


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_layout_matches_one_gpu(runs, layout):
    one, other = runs["one"], runs[layout]
    before, after = max_abs_diff(one["lp_before"], other["lp_before"]), max_abs_diff(one["lp_after"], other["lp_after"])
    print(f"\n[{layout}] max |Δ log-prob| vs one GPU: before {before:.2e}, after one step {after:.2e}; grad norm "
          f"{other['metrics']['train/grad_norm']:.6f} vs {one['metrics']['train/grad_norm']:.6f}")
    assert before < 1e-4 and after < 1e-3
    assert other["metrics"]["train/grad_norm"] == pytest.approx(one["metrics"]["train/grad_norm"], rel=1e-3)
    assert other["export_max_abs_diff"] == 0.0 and other["export_names_missing"] == []
