"""The fsdp backend on real gloo ranks (separate processes, real torch.distributed) and a tiny Qwen3.

The rank processes run tests/e2e_cpu/fsdp_worker.py; one 1-rank and one 2-rank run are shared by the
tests below (module fixture) to keep the suite fast.
"""

from __future__ import annotations

import math
import os
import time

import psutil
import pytest

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "fsdp_worker.py")


def _run_ranks(world_size: int, model_dir: str, out_dir: str, full: bool, timeout_s: float = 240) -> dict:
    # The two-rank run also uses --use-dynamic-batch-size: the same global loss, in different micro-batches.
    extra = ["--full", "--dynamic"] if full else []
    return run_ranks(WORKER, world_size, out_dir, ["--model", model_dir, *extra], timeout_s)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_actor")
    one = _run_ranks(1, tiny_model_dir, str(root / "w1"), full=False)
    two = _run_ranks(2, tiny_model_dir, str(root / "w2"), full=True)
    # The rank processes are reaped by _run_ranks; the engine server rank 0 started must be gone too.
    # (Checked by pid: a machine-wide process scan would also see other test sessions' engines.)
    deadline = time.monotonic() + 10
    while _alive(two["engine_server_pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(two["engine_server_pid"]), "the hf engine server outlived its rank-0 worker"
    return one, two


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _max_abs_diff(a, b) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)


def _objective(result, key) -> float:
    """Σ_i A_i · (masked token mean of sample i's log-probs): what one policy-gradient step should raise."""
    batch = result["batch"]
    total = 0.0
    for lp, mask, adv in zip(result[key], batch["loss_masks"], batch["rewards"]):
        n = max(1, sum(mask))
        total += adv * sum(x * m for x, m in zip(lp, mask)) / n
    return total


@pytest.mark.timeout(600)
def test_log_probs_one_rank_equal_two_ranks(runs):
    one, two = runs
    assert one["start"] == 0 and two["start"] == 0
    assert _max_abs_diff(one["lp_before"], two["lp_before"]) < 1e-5
    # Same global loss, so the same gradient: FSDP's averaging over 2 ranks is undone by the loss scale.
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy_loss", "train/kl_loss"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-4, abs=1e-6), key
    assert _max_abs_diff(one["lp_after"], two["lp_after"]) < 1e-3


@pytest.mark.timeout(600)
def test_one_train_step_moves_policy_towards_positive_advantages(runs):
    for result in runs:
        m = result["metrics"]
        assert abs(m["train/ppo_kl"]) < 1e-8  # old log-probs recomputed with the same micro-batches
        assert m["train/pg_clipfrac"] == 0.0
        assert abs(m["train/kl_loss"]) < 1e-8  # policy == reference before the first step
        assert m["train/grad_norm"] > 0 and m["train/lr"] == pytest.approx(1e-3)
        assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx(0.05, abs=1e-5)
        assert m["train/entropy_loss"] > 0
        before, after = _objective(result, "lp_before"), _objective(result, "lp_after")
        assert after > before + 1e-3, (before, after)
        # per sample, too: positively advantaged samples gain log-prob, negative ones lose it (one clear step)
        batch = result["batch"]
        ups = [sum(a) / len(a) - sum(b) / len(b) for a, b in zip(result["lp_after"], result["lp_before"])]
        agree = sum((u > 0) == (adv > 0) for u, adv in zip(ups, batch["rewards"]))
        assert agree >= len(ups) - 1, (ups, batch["rewards"])


@pytest.mark.timeout(600)
def test_one_step_with_a_reference_reuses_the_training_forward_unless_the_rewards_take_the_kl(runs):
    # One optimizer step, a KL loss against the reference, --kl-coef 0 (slime's rule): the old log-probs are the
    # training forward's own, so the only forward-only pass is the reference's, and the ratio is exactly 1.
    for result in runs:
        assert result["log_prob_passes"] == ["ref_"]
        assert result["metrics"]["train/ppo_kl"] == 0.0
    # --kl-coef: the advantages take KL(old policy || reference) before training, so the old policy's pass runs.
    assert runs[0]["log_prob_passes_kl_coef"] == ["ref_", ""]


@pytest.mark.timeout(600)
def test_loss_variants_closed_form(runs):
    one, _ = runs
    batch = one["variant_batch"]
    adv, masks = batch["rewards"], batch["loss_masks"]
    # gspo, ratio 1 at the first step; --calculate-per-token-loss: -Σ_i A_i·n_i / Σ_i n_i (n_i masked tokens)
    m = one["metrics_gspo_per_token"]
    n = [sum(mask) for mask in masks]
    want = -sum(a * k for a, k in zip(adv, n)) / sum(n)
    assert sum(adv) / len(adv) == pytest.approx(0.25)
    assert m["train/pg_loss"] == pytest.approx(want, abs=1e-6)
    assert want != pytest.approx(-0.25, abs=1e-3)  # differs from the per-sample mean, so the flag matters
    assert abs(m["train/ppo_kl"]) < 1e-8
    assert m["train/loss"] == pytest.approx(
        m["train/pg_loss"] - 0.01 * m["train/entropy_loss"] + 0.01 * m["train/kl_loss"], abs=1e-6)
    assert m["train/kl_loss"] > 0  # the policy has moved away from the reference by now
    # --use-rollout-logprobs with rollout = current + 0.05: ratio e^-0.05 everywhere, unclipped,
    # default aggregation (mean over samples of token means): pg_loss = -e^-0.05 · mean_i A_i
    m = one["metrics_rollout_logprobs"]
    assert m["train/ppo_kl"] == pytest.approx(0.05, abs=1e-5)
    assert m["train/pg_clipfrac"] == 0.0
    assert m["train/pg_loss"] == pytest.approx(-math.exp(-0.05) * 0.25, abs=1e-5)
    assert "train/train_rollout_logprob_abs_diff" not in m  # nothing recomputed to compare with
    # --ref-update-interval 3: after the third rollout (id 2) the reference model holds the actor's weights
    assert one["metrics_ref_update"]["train/ref_updated"] == 1.0 and one["ref_equals_actor"]
    assert "train/ref_updated" not in one["metrics_rollout_logprobs"]


@pytest.mark.timeout(600)
def test_save_then_load_restores_weights_and_optimizer(runs):
    _, two = runs
    assert two["start_resumed"] == 1
    assert _max_abs_diff(two["lp_resumed"], two["lp_after"]) < 1e-6
    assert _max_abs_diff(two["lp_from_pretrained"], two["lp_after"]) < 1e-5  # a plain HF folder
    # Two more optimizer steps: the resumed actor (weights + AdamW moments) tracks the original exactly,
    # the one that skipped the optimizer state (--no-load-optim) does not.
    assert _max_abs_diff(two["lp2_resumed"], two["lp2_continued"]) < 1e-6
    assert two["metrics2_resumed"]["train/loss"] == pytest.approx(two["metrics2_continued"]["train/loss"], abs=1e-7)
    assert _max_abs_diff(two["lp2_fresh_optim"], two["lp2_continued"]) > 1e-4
    # --finetune: the saved weights, but a fresh start (rollout 0, optimizer step 0)
    assert two["start_finetune"] == 0 and two["global_step_finetune"] == 0
    assert _max_abs_diff(two["lp_finetune"], two["lp_after"]) < 1e-6


@pytest.mark.timeout(600)
def test_update_weights_reaches_the_engine(runs):
    _, two = runs
    assert two["engine_weight_version"] == "1"
    assert _max_abs_diff(two["engine_lp_before_push"], two["lp_before"]) < 1e-5
    assert _max_abs_diff(two["engine_lp_after_push"], two["lp_after"]) < 1e-5
    assert _max_abs_diff(two["engine_lp_after_push"], two["engine_lp_before_push"]) > 1e-3
