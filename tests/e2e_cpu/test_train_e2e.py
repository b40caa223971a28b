"""train.py end to end on CPU: real Ray, real sglang-router, real hf engine processes, real fsdp training (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes

CUSTOM_RM = '''
async def my_reward(args, sample):
    return 1.0 if sample.response.strip().split(" ")[:1] == [str(sample.label)] else 0.0
'''


def _train_cmd(model_dir, data_path, *extra):
    return [
        sys.executable, os.path.join(REPO_ROOT, "train.py"),
        "--hf-checkpoint", model_dir, "--prompt-data", data_path, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "4", "--lr", "1e-3", "--micro-batch-size", "4", *extra,
    ]


def _env():
    return dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
                PYTHONPATH=REPO_ROOT)


def test_batch_identity_error_names_the_numbers_before_ray_starts(tiny_model_dir, toy_data_path):
    before = run_processes()
    out = subprocess.run(
        _train_cmd(tiny_model_dir, toy_data_path, "--global-batch-size", "5", "--num-rollout", "1",
                   "--rm-type", "toy", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"),
        capture_output=True, text=True, env=_env(), timeout=120,
    )
    assert out.returncode != 0
    err = out.stderr
    assert "--rollout-batch-size 4" in err and "--n-samples-per-prompt 4" in err and "--global-batch-size 5" in err
    assert "4" in err and "8" in err, err  # nearest valid global batch sizes of 16 samples: 4 and 8
    assert "Traceback" not in err, "a bad flag should be a clean error, not a stack trace"
    assert wait_for_no_new_processes(before, timeout_s=5) == {}


@pytest.mark.timeout(600)
def test_grpo_two_ranks_two_engines_custom_rm_file(tiny_model_dir, toy_data_path, tmp_path):
    rm_file = tmp_path / "my_rm.py"
    rm_file.write_text(CUSTOM_RM)
    tb_dir = tmp_path / "tb"
    before = run_processes()
    out = subprocess.run(
        _train_cmd(
            tiny_model_dir, toy_data_path,
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
            "--global-batch-size", "16", "--num-rollout", "3",
            "--custom-rm-path", f"{rm_file}:my_reward",
            "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
            "--use-tensorboard", "--tensorboard-dir", str(tb_dir),
            "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
            "--eval-prompt-data", "toy", toy_data_path, "--eval-interval", "2", "--n-samples-per-eval-prompt", "1",
            "--update-weights-interval", "2",
        ),
        capture_output=True, text=True, env=_env(), timeout=560, cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rewards = read_scalars(str(tb_dir), "rollout/raw_reward")
    assert sorted(rewards) == [0, 1, 2], rewards
    assert all(0.0 <= v <= 1.0 for v in rewards.values())
    ppo_kl = read_scalars(str(tb_dir), "train/ppo_kl")
    assert sorted(ppo_kl) == [0, 1, 2] and abs(ppo_kl[0]) < 1e-6, ppo_kl
    assert os.path.exists(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
    evals = read_scalars(str(tb_dir), "eval/toy")
    assert sorted(evals) == [0, 1], evals  # before training, then after rollout 1 (--eval-interval 2)
    # --update-weights-interval 2: one push after rollout 1; rollouts 0-1 ran on the initial push (version 1)
    assert sorted(read_scalars(str(tb_dir), "perf/update_weights_time")) == [1]
    versions = read_scalars(str(tb_dir), "rollout/weight_version/max")
    assert versions == {0: 1.0, 1: 1.0, 2: 2.0}, versions
    # the console: the eval scores on their lines, no empty `rollout K:` line; a clean teardown warns of nothing
    lines = [line.split("slime: ", 1)[1] for line in out.stderr.splitlines()
             if " INFO slime: rollout " in line and not line.startswith("(")]
    assert lines and lines[0].startswith("rollout 0: eval toy="), lines  # the eval before training
    assert any(line.startswith("rollout 1: ") and "eval toy=" in line for line in lines), lines
    assert all(line.split(":", 1)[1].strip() for line in lines), lines
    assert "closing the weight broadcast group" not in out.stdout + out.stderr, out.stderr[-4000:]
    assert wait_for_no_new_processes(before) == {}


@pytest.mark.timeout(300)
def test_failing_reward_function_stops_the_run_and_reaps_everything(tiny_model_dir, toy_data_path, tmp_path):
    rm_file = tmp_path / "broken_rm.py"
    rm_file.write_text("async def broken_rm(args, sample):\n    raise KeyError('no such field: answer')\n")
    before = run_processes()
    out = subprocess.run(
        _train_cmd(
            tiny_model_dir, toy_data_path, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
            "--global-batch-size", "16", "--num-rollout", "2", "--custom-rm-path", str(rm_file),
        ),
        capture_output=True, text=True, env=_env(), timeout=280, cwd=str(tmp_path),
    )
    assert out.returncode != 0
    assert "no such field: answer" in out.stderr, out.stderr[-3000:]
    assert wait_for_no_new_processes(before) == {}
