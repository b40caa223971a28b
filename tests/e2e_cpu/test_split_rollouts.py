"""Rollouts split into several samples (a custom generate returning list[Sample]) train on real gloo fsdp ranks:
the step is --global-batch-size rollouts whatever their rows, and two ranks whose shares differ by a row (and
so would plan different micro-batch counts) train exactly what one rank trains (tests/e2e_cpu/
split_rollouts_worker.py; the split and the per-rollout loss in pieces: tests/unit/test_batching.py,
test_losses.py)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "split_rollouts_worker.py")


@pytest.mark.timeout(400)
def test_split_rollouts_train_the_same_on_one_rank_and_on_two_uneven_ones(tiny_model_dir, tmp_path):
    one = run_ranks(WORKER, 1, str(tmp_path / "one"), ["--model", tiny_model_dir], timeout_s=180)
    two = run_ranks(WORKER, 2, str(tmp_path / "two"), ["--model", tiny_model_dir], timeout_s=180)
    for name in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert two["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-5, abs=1e-7)
    assert one["metrics"]["train/grad_norm"] > 0
    gap = max(abs(a - b) for ra, rb in zip(one["lp_after"], two["lp_after"]) for a, b in zip(ra, rb))
    assert gap < 1e-5
