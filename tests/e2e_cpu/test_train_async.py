"""train_async.py end to end on CPU: real Ray, sglang-router, hf engine process and fsdp training rank.

Overlap is proven from the run's own `timeline {...}` log lines (wall-clock spans of each rollout's
generation, training and weight push); weight versions from the samples the run dumps with
--save-debug-rollout-data. Timing is only compared, never bounded, so the machine's load does not matter.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests.conftest import REPO_ROOT
from slime.utils.tracking import read_scalars
from tests.e2e_cpu.test_sglang_engine_launch import SERVING, _install
from tests.e2e_cpu.test_train_e2e import _env



def _cmd(model_dir, data_path, tmp_path, num_rollout, *extra):
    return [
        sys.executable, os.path.join(REPO_ROOT, "train_async.py"),
        "--hf-checkpoint", model_dir, "--prompt-data", data_path, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "toy", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--global-batch-size", "16", "--micro-batch-size", "16", "--lr", "1e-3", "--advantage-estimator", "grpo",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--num-rollout", str(num_rollout), "--use-tensorboard", "--tensorboard-dir", str(tmp_path / "tb"),
        "--save-debug-rollout-data", str(tmp_path / "dump" / "rollout_{rollout_id}.pt"), *extra,
    ]


def _marked_env() -> tuple[dict, str]:
    """The e2e env plus a marker every process of this run inherits (Ray daemons, actors, engine servers), so
    the leak check sees only our processes on a machine where others run tests at the same time."""
    marker = uuid.uuid4().hex
    return dict(_env(), SLIME_ASYNC_TEST_MARK=marker), marker


def _left_over(marker: str, timeout_s: float = 30.0) -> dict[int, str]:
    deadline = time.time() + timeout_s
    while True:
        left = {}
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if p.environ().get("SLIME_ASYNC_TEST_MARK") == marker:
                    left[p.pid] = " ".join(p.info["cmdline"] or [])[:200]
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def _run(cmd, tmp_path):
    env, marker = _marked_env()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=560, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-4000:]
    assert _left_over(marker) == {}
    return out


def _timeline(out) -> dict[int, dict]:
    lines = re.findall(r"timeline (\{.*\})", out.stdout + out.stderr)
    return {d["rollout_id"]: d for d in map(json.loads, lines)}


def _versions(tmp_path) -> dict[int, list[list[str]]]:
    import torch

    found = {}
    for path in glob.glob(str(tmp_path / "dump" / "rollout_*.pt")):
        data = torch.load(path, weights_only=False)
        found[data["rollout_id"]] = [s["weight_versions"] for s in data["samples"]]
    return found


def _assert_overlap_and_no_push_mid_generation(timeline: dict[int, dict], num_rollout: int) -> None:
    assert sorted(timeline) == list(range(num_rollout)), timeline
    for k in range(num_rollout - 1):
        nxt, cur = timeline[k + 1], timeline[k]
        assert nxt["generate_start"] < cur["train_end"], f"generation of {k + 1} did not start before training of {k} ended"
        assert nxt["generate_end"] <= cur["push_start"], f"weights of push {k} were pushed while rollout {k + 1} generated"


def test_colocate_is_refused_before_anything_starts(tiny_model_dir, toy_data_path, tmp_path):
    env, marker = _marked_env()
    out = subprocess.run(_cmd(tiny_model_dir, toy_data_path, tmp_path, 1, "--colocate"),
                         capture_output=True, text=True, env=env, timeout=120, cwd=str(tmp_path))
    assert out.returncode != 0
    assert "--colocate" in out.stderr and "train.py" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "placement group" not in out.stderr  # refused before Ray
    assert _left_over(marker, timeout_s=5) == {}


@pytest.mark.timeout(600)
def test_one_step_off_generation_overlaps_training(tiny_model_dir, toy_data_path, tmp_path, monkeypatch):
    """Through the SGLang engine actor (`--rollout-backend sglang`): SGLang cannot run here, so the `sglang`
    command on PATH records its argv and serves the hf engine (tests/e2e_cpu/test_sglang_engine_launch.py);
    everything else (launch, health, the distributed weight push, shutdown) is the SGLang path's."""
    _install(tmp_path, monkeypatch, SERVING)
    monkeypatch.setenv("FAKE_SGLANG_ARGV", str(tmp_path / "argv.json"))
    n = 4
    out = _run(_cmd(tiny_model_dir, toy_data_path, tmp_path, n, "--rollout-max-response-len", "4",
                    "--rollout-backend", "sglang"), tmp_path)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[0] == "serve" and argv[argv.index("--model-path") + 1] == tiny_model_dir
    _assert_overlap_and_no_push_mid_generation(_timeline(out), n)

    versions = _versions(tmp_path)
    # push 1 before rollout 0; rollout k >= 1 is generated while rollout k-1 trains, i.e. by version k
    assert {k: {tuple(v) for v in vs} for k, vs in versions.items()} == {0: {("1",)}, 1: {("1",)}, 2: {("2",)},
                                                                         3: {("3",)}}
    lag = read_scalars(str(tmp_path / "tb"), "rollout/weight_version_lag/max")
    assert lag == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}, lag
    for tag in ("perf/train_wait_time_ratio", "perf/rollout_wait_time_ratio"):
        values = read_scalars(str(tmp_path / "tb"), tag)
        assert values and all(0.0 <= v <= 1.0 for v in values.values()), (tag, values)


@pytest.mark.timeout(600)
def test_groups_past_the_lag_bound_are_dropped_at_training(tiny_model_dir, toy_data_path, tmp_path):
    """A push every other step, bound 0: rollout 2 is generated during step 1, before its push, so it trains one
    version behind and all of it is dropped (loss mask 0, counted); rollouts 0, 1 and 3 are on-policy."""
    out = _run(_cmd(tiny_model_dir, toy_data_path, tmp_path, 4, "--rollout-max-response-len", "4",
                    "--update-weights-interval", "2", "--max-policy-version-lag", "0",
                    "--dump-details", str(tmp_path / "details")), tmp_path)
    _assert_trained_within_lag(tmp_path, out, 0, partial=False)
    dropped = read_scalars(str(tmp_path / "tb"), "rollout/stale_samples_dropped")
    assert dropped == {0: 0.0, 1: 0.0, 2: 16.0, 3: 0.0}, dropped
    assert "rollout 2: 4 group(s) more than --max-policy-version-lag 0 versions behind" in out.stderr


FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
HELD_AT_PUSH = "tests.e2e_cpu.plugins.held_at_push.generate"


def _policy_version(weight_versions) -> int | None:
    versions = [int(v) for v in weight_versions if str(v).isdigit()]
    return min(versions) if versions else None


def _assert_trained_within_lag(tmp_path, out, max_lag: int, partial: bool) -> None:
    """From the --dump-details output: every trained row (a loss-mask token left) of every rollout is at
    most `max_lag` versions behind the version it was trained at; the logged lag, drop and off-policy metrics
    are what the dumps say. Rollout r trains at the version pushed after step r - 1 (1 for rollout 0)."""
    import torch

    timeline = _timeline(out)
    tb = str(tmp_path / "tb")
    logged = {tag: read_scalars(tb, f"rollout/{tag}") for tag in
              ("policy_version_lag_max", "stale_samples_dropped", "offpolicy_token_share")}
    trained_lags, segmented = [], 0
    for r in sorted(timeline):
        current = timeline[r - 1]["weight_version"] if r > 0 else 1
        assert timeline[r].get("trained_policy_version", current) == current
        samples = torch.load(str(tmp_path / "dump" / f"rollout_{r}.pt"), weights_only=False)["samples"]
        rows = torch.load(str(tmp_path / "details" / "train_data" / f"{r}.pt"), weights_only=False)["samples"]
        assert len(rows) == len(samples)
        lags = [current - v for v in (_policy_version(s["weight_versions"]) for s in samples) if v is not None]
        assert lags and logged["policy_version_lag_max"][r] == max(lags)
        dropped = off = known = 0
        for s, row in zip(samples, rows):
            mask = [int(m) for m in row["loss_masks"]]
            lag = current - _policy_version(s["weight_versions"])
            if lag > max_lag:
                dropped += 1
                assert sum(mask) == 0, f"rollout {r}: a sample {lag} versions behind was trained (bound {max_lag})"
            elif sum(mask):
                trained_lags.append(lag)
            versions = s["token_policy_versions"]
            assert len(versions) == s["response_length"] and versions == sorted(versions)
            assert {str(v) for v in versions} <= set(s["weight_versions"])
            segmented += len(set(versions)) > 1
            for m, v in zip(mask, versions):
                known += bool(m)
                off += bool(m) and v < current
        assert logged["stale_samples_dropped"][r] == dropped
        if known:
            assert logged["offpolicy_token_share"][r] == pytest.approx(off / known)
        else:  # nothing trained: no share is logged
            assert r not in logged["offpolicy_token_share"]
    assert trained_lags and max(trained_lags) <= max_lag
    if partial:  # a response continued after a push holds a run of tokens per version
        assert segmented > 0, "no trained response was continued across a push: per-segment versions untested"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("partial,max_lag", [(False, 1), (True, 3)], ids=["abort-restart", "partial-rollout"])
def test_fully_async_rollout_versions_at_pushes(tiny_model_dir, toy_data_path, tmp_path, partial, max_lag):
    # The aborts of push k are reported by collection k + 2, so the pushes after rollouts 0 .. n - 3 are the
    # observed ones. Groups must be in flight at those pushes: every 8th group's first attempt is held
    # generating until a push aborts it (tests/e2e_cpu/plugins/held_at_push.py), so this does not depend on
    # generation outlasting a training step (under CI's load it once did not at any push). A continued held group
    # finishes right after its push but may wait for the collection after the next one (the buffer can already hold
    # a rollout's groups): 2 versions behind when collected, 3 when trained, so the partial run's bound is 3 (with 2
    # such a group was regenerated as stale and no continued response was left to check, also once under CI).
    n = 6
    # --async-buffer-size also lets the driver collect that many rollouts ahead, so it stays 1: with a large one
    # every collection happened before the first push after training, and the aborts it caused were never reported.
    # 4 groups in flight, not 8: groups cut short by a push are relaunched only once fewer than a rollout's groups
    # wait to be collected, and with 8 in flight up to 11 could wait; the continued groups then waited behind them
    # for two collections and were regenerated as stale (seen with the machine loaded).
    extra = ["--rollout-function-path", FULLY_ASYNC, "--rollout-max-response-len", "512",
             "--custom-generate-function-path", HELD_AT_PUSH,
             "--over-sampling-batch-size", "4", "--async-buffer-size", "1"] + (["--partial-rollout"] if partial else [])
    # bounded staleness (--max-policy-version-lag) and --dump-details for the trained rows
    extra += ["--max-policy-version-lag", str(max_lag), "--dump-details", str(tmp_path / "details")]
    out = _run(_cmd(tiny_model_dir, toy_data_path, tmp_path, n, *extra), tmp_path)
    _assert_trained_within_lag(tmp_path, out, max_lag, partial)
    _assert_overlap_and_no_push_mid_generation(_timeline(out), n)

    tb = str(tmp_path / "tb")
    aborted = sum(read_scalars(tb, "rollout/aborted_groups").values())
    assert aborted > 0, "no group was in flight at any push: the test proves nothing about versions"
    samples = [vs for vs in _versions(tmp_path).values() for vs in vs]
    assert len(samples) == n * 16
    mixed = [vs for vs in samples if len(set(vs)) > 1]
    assert sum(read_scalars(tb, "rollout/mixed_version_samples").values()) == len(mixed)
    if partial:
        # continued samples list each version they were generated with, oldest first
        assert all([int(v) for v in vs] == sorted(int(v) for v in vs) for vs in mixed)
    else:
        assert mixed == [], f"a response mixes weight versions without --partial-rollout: {mixed[:3]}"
