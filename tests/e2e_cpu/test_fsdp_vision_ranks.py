"""Two fsdp ranks of a vision-language model (the tiny Qwen2.5-VL; the tiny Qwen3-VL, whose deepstack mergers join
too) where one rank's rows have no image: the rank without images still
runs the vision tower's collectives (on a stand-in image counted zero times), so the step neither hangs nor
changes: the same metrics and log-probs as one rank training the same batch
(tests/e2e_cpu/fsdp_vision_ranks_worker.py)."""

from __future__ import annotations

import math
import os

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "fsdp_vision_ranks_worker.py")


def _max_abs_diff(a, b) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_a_rank_without_images_trains_as_one_rank_would(arch, tmp_path):
    from tools.make_tiny_model import make_tiny_model

    vlm = make_tiny_model(str(tmp_path / "vlm"), arch=arch, size="tiny", seed=0)
    one = run_ranks(WORKER, 1, str(tmp_path / "w1"), ["--model", vlm], timeout_s=240)
    two = run_ranks(WORKER, 2, str(tmp_path / "w2"), ["--model", vlm], timeout_s=240)
    assert _max_abs_diff(one["lp_before"], two["lp_before"]) < 1e-5
    assert all(math.isfinite(v) for v in two["metrics"].values())
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy_loss"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    assert _max_abs_diff(one["lp_after"], two["lp_after"]) < 1e-4
    assert _max_abs_diff(two["lp_after"], two["lp_before"]) > 1e-3  # the step moved the policy
    assert two["vision_params"] > 0
