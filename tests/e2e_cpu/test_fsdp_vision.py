"""The fsdp backend on the tiny Qwen2.5-VL and the tiny Qwen3-VL (deepstack features, interleaved mrope) with the
hf engine: rows generated from images train with the images
in the forward, the trainer's log-probs equal the engine's (before and after a weight push), and a policy step
moves them. One gloo rank (tests/e2e_cpu/fsdp_vision_worker.py)."""

from __future__ import annotations

import math
import os

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "fsdp_vision_worker.py")
TOL = 1e-5


def _max_abs_diff(a, b) -> float:
    """Over the rows both have (None: a row the engine was not asked to score)."""
    pairs = [(ra, rb) for ra, rb in zip(a, b) if ra is not None and rb is not None]
    assert pairs and all(len(ra) == len(rb) for ra, rb in pairs)
    return max(abs(x - y) for ra, rb in pairs for x, y in zip(ra, rb))


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def run(request, tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("fsdp_vision")
    vlm = make_tiny_model(str(root / "vlm"), arch=request.param, size="tiny", seed=0)
    return run_ranks(WORKER, 1, str(root / "w1"), ["--model", vlm], timeout_s=300)


@pytest.mark.timeout(400)
def test_trainer_log_probs_equal_the_engines_with_images(run):
    assert all(g is not None for g in run["grid"][:6]) and run["grid"][6:] == [None, None]
    # row 5's response sampled an image token: the trainer treats it as the text token the engine fed back
    assert run["stray_image_tokens"][5] >= 1
    assert _max_abs_diff(run["trainer_lp_before"], run["rollout_lp"]) < TOL
    assert _max_abs_diff(run["trainer_lp_before"][5:6], run["rollout_lp"][5:6]) < TOL


@pytest.mark.timeout(400)
def test_one_step_moves_the_policy_and_reaches_the_engine(run):
    metrics = run["metrics"]
    assert all(math.isfinite(v) for v in metrics.values())
    assert abs(metrics["train/ppo_kl"]) < 1e-6  # old log-probs recomputed with the images: ratio 1 on step one
    assert run["engine_weight_version"] == "1"
    assert all(row is not None for row in run["engine_lp_before_push"])  # row 5's sampled image token included
    assert _max_abs_diff(run["engine_lp_before_push"], run["rollout_lp"]) < TOL
    assert _max_abs_diff(run["engine_lp_after_push"], run["trainer_lp_after"]) < TOL
    assert _max_abs_diff(run["engine_lp_after_push"], run["engine_lp_before_push"]) > 1e-3
