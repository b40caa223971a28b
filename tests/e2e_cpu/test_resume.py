"""train.py stopped after a checkpoint and resumed with --load gets the prompts an uninterrupted run gets;
a rollout dump replayed with --debug-train-only --load-debug-rollout-data trains to the same first loss.

The dataset has 6 prompts and each rollout takes 4 with --rollout-shuffle, so the runs cross epochs (each
epoch reshuffled with --rollout-seed + epoch): the data source's offset and epoch must both be restored.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from slime.utils.tracking import read_scalars
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.test_train_e2e import _env, _train_cmd
from tests.e2e_cpu.together import result_of, run_together


def _prompts(template: str, rollout_id: int) -> list[str]:
    saved = torch.load(template.format(rollout_id=rollout_id), weights_only=False)
    return [str(s["prompt"]) for s in saved["samples"]]


def _run(model_dir, data, tmp_path, name, *extra):
    out = subprocess.run(
        _train_cmd(model_dir, data, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                   "--global-batch-size", "16", "--rm-type", "toy", "--rollout-shuffle", "--rollout-seed", "3",
                   "--entropy-coef", "0.01",
                   "--use-tensorboard", "--tensorboard-dir", str(tmp_path / name / "tb"), *extra),
        capture_output=True, text=True, env=_env(), timeout=400, cwd=str(tmp_path),
    )
    assert out.returncode == 0, f"{name}: {out.stderr[-4000:]}"
    return str(tmp_path / name / "tb")


@pytest.mark.timeout(900)
def test_resume_gets_the_same_prompts_and_replay_the_same_loss(tiny_model_dir, toy_data_path, tmp_path):
    data = tmp_path / "six.jsonl"
    with open(toy_data_path) as f:
        data.write_text("".join(f.readline() for _ in range(6)))
    before = run_processes()
    dump_a, dump_c = str(tmp_path / "a" / "rollout_{rollout_id}.pt"), str(tmp_path / "c" / "rollout_{rollout_id}.pt")

    # run a also builds its dataset in 2 worker processes (spawned from the rollout manager's Ray actor); the
    # other runs use none, so the comparisons below also show that workers change nothing
    tb_a = _run(tiny_model_dir, str(data), tmp_path, "a", "--num-rollout", "4", "--save-debug-rollout-data", dump_a,
                "--num-data-workers", "2", "--save", str(tmp_path / "ckpt_a"), "--save-interval", "2")
    # the run as it was when interrupted after its checkpoint at rollout 1: the later checkpoint is not there
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tmp_path / "ckpt_a", ckpt)
    shutil.rmtree(ckpt / "iter_0000003")
    (ckpt / "rollout" / "data_source_state_3.json").unlink()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    # run c resumes from run a's checkpoint and run d replays run a's dump: the two at once (together.py)
    later = {"c": ("--num-rollout", "4", "--load", str(ckpt), "--save-debug-rollout-data", dump_c),
             "d": ("--num-rollout", "1", "--debug-train-only", "--load-debug-rollout-data", dump_a)}
    runs = run_together(lambda name: _run(tiny_model_dir, str(data), tmp_path, name, *later[name]), later)
    tb_c = result_of(runs, "c")

    assert len(set(_prompts(dump_a, 0) + _prompts(dump_a, 1))) == 6  # the runs do cross an epoch boundary
    for rollout_id in (2, 3):
        assert _prompts(dump_c, rollout_id) == _prompts(dump_a, rollout_id), f"rollout {rollout_id}"
    assert sorted(read_scalars(tb_c, "rollout/raw_reward")) == [2, 3]  # metric steps continue, not restart

    tb_d = result_of(runs, "d")
    # the policy-gradient part of the first step is ~0 (a random model earns no reward, ratio 1), so an
    # entropy bonus makes the loss and gradient depend on every sample and token
    for tag in ("train/loss", "train/grad_norm", "train/entropy_loss"):
        first_a, first_d = read_scalars(tb_a, tag)[0], read_scalars(tb_d, tag)[0]
        print(f"{tag}: run {first_a!r}, replay {first_d!r}")
        assert first_d == pytest.approx(first_a, rel=1e-5, abs=1e-7), tag
    assert read_scalars(tb_a, "train/grad_norm")[0] > 1e-3
    assert wait_for_no_new_processes(before) == {}


@pytest.mark.timeout(300)
def test_driver_killed_while_saving_leaves_no_gap_in_the_curves(tiny_model_dir, toy_data_path, tmp_path):
    """A rollout's metrics reach TensorBoard before its checkpoint is written: the driver SIGKILLed the moment
    rollout 1's checkpoint folder appears has logged rollouts 0 and 1, so a resume from the last complete
    checkpoint continues the curve without a gap."""
    import signal
    import time

    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    cmd = _train_cmd(tiny_model_dir, toy_data_path, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                     "--global-batch-size", "16", "--rm-type", "toy", "--num-rollout", "4",
                     "--save", str(save), "--save-interval", "1", "--use-tensorboard", "--tensorboard-dir", str(tb))
    before = run_processes()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=_env(), cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 240
        while not (save / "iter_0000001").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (save / "iter_0000001").exists(), "rollout 1's checkpoint never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    left = wait_for_no_new_processes(before, timeout_s=90)
    assert left == {}, left
    logged = read_scalars(str(tb), "train/loss")
    assert {0, 1} <= set(logged), f"TensorBoard steps of train/loss: {sorted(logged)}"
