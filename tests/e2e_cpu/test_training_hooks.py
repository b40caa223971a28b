"""The training-side hooks and flags slime users bring, on real gloo ranks of both backends (megatron through the
CPU shim): plugins written to slime's contracts (tests/e2e_cpu/training_plugins.py) are called where slime calls
them, with slime's arguments, and what they do is what training uses; --keep-old-actor's old log-probs come from
the weights of the push before the last; --balance-data gives the data-parallel ranks close token counts; a NaN
loss stops the megatron step unless --no-check-for-nan-in-loss-and-grad.

The rank processes run tests/e2e_cpu/training_hooks_worker.py (init -> push -> (train -> push) per rollout, the
same batch every rollout, its rollout log-probs the initial policy's).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e_cpu.ranks import run_ranks

WORKER = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "training_hooks_worker.py")
PLUGINS = os.path.join(REPO_ROOT, "tests", "e2e_cpu", "training_plugins.py")
HAS_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
ABS_DIFF = "train/train_rollout_logprob_abs_diff"
SKEWED_LENGTHS = [39, 32, 8, 5, 10, 7, 8, 10]  # the worker's --skewed batch


def run(model: str, root, monkeypatch, name: str, backend: str, world: int = 1, rollouts: int = 1,
        kl: bool = False, skewed: bool = False, extra: str = "") -> tuple[dict, list[dict]]:
    """rank 0's result and every hook call (in order per rank) of one worker run."""
    out = root / name
    out.mkdir()
    log = out / "hooks.jsonl"
    monkeypatch.setenv("SLIME_TEST_HOOK_LOG", str(log))
    flags = ["--model", model, "--backend", backend, "--rollouts", str(rollouts), f"--extra=--weight-decay 0 {extra}"]
    flags += ["--kl"] if kl else []
    flags += ["--skewed"] if skewed else []
    result = run_ranks(WORKER, world, str(out), flags, timeout_s=300)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def max_abs_diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def of_rank(calls: list[dict], rank: int) -> list[dict]:
    return [c for c in calls if c["rank"] == rank]


def token_sums(calls: list[dict], rollout_id: int = 0) -> dict[int, int]:
    return {c["rank"]: sum(c["total_lengths"]) for c in calls
            if c["event"] == "rollout_data_postprocess" and c["rollout_id"] == rollout_id}


def assert_balanced(sums: dict[int, int]) -> None:
    contiguous = [sum(SKEWED_LENGTHS[:4]), sum(SKEWED_LENGTHS[4:])]  # 84 vs 35 without --balance-data
    assert sorted(sums) == [0, 1] and sum(sums.values()) == sum(contiguous)
    assert abs(sums[0] - sums[1]) <= 5 < abs(contiguous[0] - contiguous[1])


@pytest.mark.timeout(600)
def test_fsdp_rollout_data_postprocess_edits_are_trained_on_and_ranks_are_balanced(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    """fn(args, rollout_id, rollout_data) on each rank with slime's keys; the hook zeroes every loss mask, so
    nothing is trained on (zero loss and gradient, the weights do not move)."""
    result, calls = run(tiny_model_dir, tmp_path, monkeypatch, "fsdp_pp", "fsdp", world=2, rollouts=2, skewed=True,
                        extra=f"--balance-data --rollout-data-postprocess-path {PLUGINS}:zero_loss_masks")
    hook = [c for c in calls if c["event"] == "rollout_data_postprocess"]
    assert sorted((c["rollout_id"], c["rank"]) for c in hook) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first = hook[0]
    assert first["args"] == "Namespace" and first["mask_dtype"] == "torch.int32"
    assert {"tokens", "response_lengths", "total_lengths", "rewards", "raw_reward", "truncated", "loss_masks",
            "advantages", "rollout_log_probs", "partition"} <= set(first["keys"])
    assert all(first["lengths"][k] == first["response_lengths"] for k in first["lengths"])
    assert sorted(r for c in hook if c["rollout_id"] == 0 for r in c["partition"]) == list(range(8))
    for metrics in result["metrics"]:
        assert metrics["train/loss"] == 0.0 and metrics["train/grad_norm"] == 0.0
    assert max_abs_diff(result["lp_initial"], result["lp_after"][-1]) == 0.0
    assert_balanced(token_sums(calls))


@pytest.mark.timeout(600)
def test_keep_old_actor_recomputes_with_the_weights_of_the_push_before_the_last(tiny_model_dir, tmp_path, monkeypatch):
    """Rollout log-probs are the initial weights' (W0). Pushes: W0 (start), W1 (after rollout 0), W2. Without the
    flag rollout k's old policy is W_k; with it (interval 1) W0, W0, W1: the recomputed-vs-rollout gap is 0 for
    rollouts 0 and 1 and, at rollout 2, the gap between W1 and W0 that the plain run sees at rollout 1."""
    base, _ = run(tiny_model_dir, tmp_path, monkeypatch, "base", "fsdp", rollouts=3)
    keep, _ = run(tiny_model_dir, tmp_path, monkeypatch, "keep", "fsdp", rollouts=3, extra="--keep-old-actor")
    gaps, plain = [m[ABS_DIFF] for m in keep["metrics"]], [m[ABS_DIFF] for m in base["metrics"]]
    assert gaps[0] == pytest.approx(0.0, abs=1e-6) and gaps[1] == pytest.approx(0.0, abs=1e-6)
    assert plain[1] > 0.1 and gaps[2] == pytest.approx(plain[1], rel=1e-5)
    # The policy trained at rollout 1 is W1 while its old policy is W0: the ratio is no longer 1.
    assert keep["metrics"][1]["train/ppo_kl"] != 0.0 and base["metrics"][1]["train/ppo_kl"] == 0.0
    # Rollout 0 is the same in both runs (its old policy is the trained one either way).
    assert max_abs_diff(keep["lp_after"][0], base["lp_after"][0]) < 1e-6
    if HAS_MCORE:  # the same queue in the megatron backend, built from a --spec function
        mg, calls = run(tiny_model_dir, tmp_path, monkeypatch, "megatron_keep", "megatron", rollouts=3,
                        extra="--keep-old-actor --spec tests.e2e_cpu.training_plugins layer_spec")
        assert calls == [{"event": "spec", "rank": 0, "args": "Namespace", "config": "TransformerConfig",
                          "vp_stage": None}]
        mg_gaps = [m[ABS_DIFF] for m in mg["metrics"]]
        assert mg_gaps[0] == pytest.approx(0.0, abs=1e-6) and mg_gaps[1] == pytest.approx(0.0, abs=1e-6)
        assert mg_gaps[2] == pytest.approx(plain[1], rel=1e-4)


@pytest.mark.skipif(not HAS_MCORE, reason="megatron-core not installed")
@pytest.mark.timeout(600)
def test_megatron_hooks_are_called_with_slimes_arguments_and_used(tiny_model_dir, tmp_path, monkeypatch):
    hooks = (f"--custom-megatron-init-path {PLUGINS}:on_init "
             f"--custom-megatron-before-log-prob-hook-path {PLUGINS}:before_log_prob "
             f"--custom-megatron-before-train-step-hook-path {PLUGINS}:before_train_step "
             f"--custom-model-provider-path {PLUGINS}:model_provider "
             f"--rollout-data-postprocess-path {PLUGINS}:record_rollout_data --balance-data")
    result, calls = run(tiny_model_dir, tmp_path, monkeypatch, "megatron_hooks", "megatron", world=2, rollouts=2,
                        kl=True, skewed=True, extra=hooks)
    # Per rank: init (parallel groups up) before the policy and the reference model are built by the provider;
    # per rollout the reference's log-prob pass, the postprocess hook, one optimizer step (one step per rollout
    # and a KL loss: the old log-probs are the training forward's own, as in slime).
    per_rollout = ["before_log_prob", "rollout_data_postprocess", "before_train_step"]
    for rank in (0, 1):
        mine = of_rank(calls, rank)
        assert [c["event"] for c in mine] == ["init", "model_provider", "model_provider", *per_rollout * 2]
        assert mine[0]["args"] == "Namespace" and mine[0]["parallel_ready"]
        assert all((c["pre_process"], c["post_process"], c["vp_stage"], c["config"]) ==
                   (True, True, None, "TransformerConfig") for c in mine[1:3])
        assert [c["store_prefix"] for c in mine if c["event"] == "before_log_prob"] == ["ref_", "ref_"]
        steps = [c for c in mine if c["event"] == "before_train_step"]
        assert [(c["rollout_id"], c["step_id"]) for c in steps] == [(0, 0), (1, 0)]
        assert all(c["grads_zeroed"] and c["scheduler"] == "OptimizerParamScheduler" and c["chunks"] == 1
                   for c in steps)
        post = [c for c in mine if c["event"] == "rollout_data_postprocess"]
        assert {"ref_log_probs", "advantages"} <= set(post[0]["keys"])
        assert "log_probs" not in post[0]["keys"]  # slime's: absent when the training forward gives them
    # Their effects: the reference model (final norm zeroed) predicts uniformly, so the KL loss is not 0 as with
    # ref = policy; the step hook set the learning rate to 0, so the weights did not move.
    assert abs(result["metrics"][0]["train/kl_loss"]) > 1e-3
    assert max_abs_diff(result["lp_initial"], result["lp_after"][-1]) == 0.0
    assert_balanced(token_sums(calls))


@pytest.mark.skipif(not HAS_MCORE, reason="megatron-core not installed")
@pytest.mark.timeout(600)
def test_megatron_nan_loss_stops_the_step_unless_the_check_is_off(tiny_model_dir, tmp_path, monkeypatch):
    poison = f"--custom-megatron-before-train-step-hook-path {PLUGINS}:poison_final_norm"
    with pytest.raises(pytest.fail.Exception) as info:
        run(tiny_model_dir, tmp_path, monkeypatch, "nan_checked", "megatron", extra=poison)
    assert "FloatingPointError: rank 0: the loss of rollout 0, optimizer step 0 is nan (rows [0, 1])" in str(info.value)
    result, _ = run(tiny_model_dir, tmp_path, monkeypatch, "nan_unchecked", "megatron",
                    extra=f"{poison} --no-check-for-nan-in-loss-and-grad")
    assert math.isnan(result["metrics"][0]["train/loss"])
