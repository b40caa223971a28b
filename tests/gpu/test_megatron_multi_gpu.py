"""The Megatron backend across two GPUs (run on nvidia-h200-x2): the layouts of the CPU-shim tests
(tests/e2e_cpu/test_megatron_actor.py) over NCCL, in fp32, against one GPU: TP2, PP2 (+ a colocated
CUDA-IPC push from two stages), DP2 with the distributed optimizer (+ a push by NCCL broadcast to an `hf`
engine on the other GPU), dynamic micro-batches, a TP2 checkpoint loaded at TP1, and a tiny Qwen3-MoE
at EP2 against EP1. Sequence parallelism is tested on the CPU shim (tests/e2e_cpu/test_megatron_vision_language.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.e2e_cpu.test_megatron_actor import LAYOUTS, max_abs_diff, run_layouts

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]
# fp32 on GPUs: reduction order differs between layouts (all-reduce, pipeline p2p), so per-token
# log-probs agree to ~1e-6 rather than bit for bit.
BEFORE, AFTER = 1e-4, 1e-3


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("multi_gpu"), tiny_model_dir)


def _report(name: str, one: dict, other: dict) -> tuple[float, float]:
    before, after = max_abs_diff(one["lp_before"], other["lp_before"]), max_abs_diff(one["lp_after"], other["lp_after"])
    m, m1 = other["metrics"], one["metrics"]
    print(f"\n[{name}] max |Δ log-prob| vs one GPU: before {before:.2e}, after one step {after:.2e}; loss "
          f"{m['train/loss']:.6f} vs {m1['train/loss']:.6f}; grad norm {m['train/grad_norm']:.6f} vs "
          f"{m1['train/grad_norm']:.6f}")
    return before, after


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_gpu(runs, layout):
    one, other = runs["one"], runs[layout]
    before, after = _report(layout, one, other)
    assert before < BEFORE and after < AFTER
    for key in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm"):
        assert other["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-3, abs=1e-5), key
    assert other["export_max_abs_diff"] == 0.0 and other["export_names_missing"] == []


@pytest.mark.timeout(1200)
def test_moe_expert_parallel_matches_one_gpu(runs):
    before, after = _report("moe_ep2", runs["moe_one"], runs["moe_ep2"])
    assert before < BEFORE and after < AFTER
    assert runs["moe_ep2"]["metrics"]["train/loss"] == pytest.approx(runs["moe_one"]["metrics"]["train/loss"],
                                                                     rel=1e-3, abs=1e-5)
    assert runs["moe_ep2"]["export_max_abs_diff"] == 0.0


@pytest.mark.timeout(1200)
def test_tp2_checkpoint_loads_at_tp1(runs):
    loaded = runs["loaded"]
    gap = max_abs_diff(loaded["lp_before"], runs["tp2"]["lp_after"])
    print(f"\n[loaded] TP2 checkpoint at TP1: start rollout {loaded['start']}, max |Δ log-prob| {gap:.2e}")
    assert loaded["start"] == 1 and gap < BEFORE


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", ["pp2", "dp2"])
def test_weight_push_reaches_the_engine(runs, layout):
    """pp2: colocated CUDA-IPC handles from two pipeline stages; dp2: NCCL broadcast to an engine on the
    other GPU (update_weights_from_distributed). The engine runs in bf16 on CUDA, the trainer in fp32."""
    r = runs[layout]
    gap = max_abs_diff(r["engine_lp_after_push"], r["lp_after"])
    print(f"\n[{layout}] engine (bf16) vs trainer (fp32) log-prob max |Δ| after push: {gap:.2e}")
    assert r["engine_weight_version"] == "1" and gap < 0.1
