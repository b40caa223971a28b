"""--megatron-config-path through train.py on CPU: the actor group and the PPO critic group are each built from
their role's copy of the args (real Ray, sglang-router, hf engine, fsdp actor and critic)."""

from __future__ import annotations

import subprocess

import pytest

from slime.utils.tracking import read_scalars
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.test_train_e2e import _env, _train_cmd


@pytest.mark.timeout(600)
def test_actor_and_critic_train_with_their_roles_overrides(tiny_model_dir, toy_data_path, tmp_path):
    (tmp_path / "roles.yaml").write_text(
        "megatron:\n"
        "  - {name: default, role: actor, overrides: {lr: 2e-3, use_kl_loss: true, kl_loss_coef: 0.01}}\n"
        "  - {name: default, role: critic, overrides: {lr: 3e-4}}\n"
    )
    tb_dir = tmp_path / "tb"
    before = run_processes()
    cmd = _train_cmd(tiny_model_dir, toy_data_path, "--advantage-estimator", "ppo", "--actor-num-gpus-per-node", "1",
                     "--rollout-num-gpus", "1", "--global-batch-size", "16", "--num-rollout", "1", "--rm-type", "toy",
                     "--use-tensorboard", "--tensorboard-dir", str(tb_dir),
                     "--megatron-config-path", str(tmp_path / "roles.yaml"))  # fmt: skip
    assert "--use-kl-loss" not in cmd and cmd[cmd.index("--lr") + 1] == "1e-3"
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=560, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-4000:]
    assert read_scalars(str(tb_dir), "train/lr") == {0: pytest.approx(2e-3)}  # the actor's lr, not --lr 1e-3
    assert read_scalars(str(tb_dir), "critic/lr") == {0: pytest.approx(3e-4)}  # the critic's
    # the actor's use_kl_loss built its reference model: the KL to it is logged (0 at the first step)
    kl = read_scalars(str(tb_dir), "train/kl_loss")
    assert sorted(kl) == [0] and abs(kl[0]) < 1e-6, kl
    assert wait_for_no_new_processes(before) == {}
