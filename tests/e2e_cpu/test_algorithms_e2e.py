"""The advantage estimators through train.py on CPU: real Ray, sglang-router, hf engine, fsdp ranks.

Invariants slime checks in CI: at the first step ppo_kl is 0 (the old-policy pass repeats the training
forward) and the KL to the reference is 0 (the reference is the initial policy); the trainer's log-probs
match the engine's. PPO runs with a critic group on 2 data-parallel ranks (values gathered across ranks,
advantages whitened with all-reduced moments).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from slime.utils.tracking import read_scalars
from tests.e2e_cpu.rewards import ALTERNATING
from tests.e2e_cpu.test_train_async import _left_over, _marked_env
from tests.e2e_cpu.test_train_e2e import _train_cmd
from tests.e2e_cpu.together import result_of, run_together

# GRPO's first step is checked by tests/e2e_cpu/test_seed_workflows.py::test_step3_standard_grpo.
RUNS = {
    "ppo": ["--advantage-estimator", "ppo", "--use-kl-loss", "--kl-loss-coef", "0.01", "--normalize-advantages",
            "--gamma", "1.0", "--lambd", "0.95", "--critic-lr", "1e-3",
            "--num-critic-only-steps", "1", "--actor-num-gpus-per-node", "2", "--num-rollout", "3"],
    "reinforce_plus_plus": ["--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages",
                            "--kl-coef", "0.01", "--kl-loss-type", "k3", "--use-unbiased-kl",
                            "--actor-num-gpus-per-node", "1", "--num-rollout", "2"],
}


def _train(cmd, tmp_path, timeout: int):
    """One train.py run in `tmp_path`; its processes carry a marker of their own, so the leak check sees only them
    while the module's other run goes on beside it."""
    env, marker = _marked_env()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-4000:]
    assert _left_over(marker) == {}
    return out


def _estimator_run(tmp_path, tiny_model_dir, toy_data_path, estimator):
    """The estimator's run (PPO: also resumed from its checkpoint for one more rollout); returns its folder."""
    tmp_path.mkdir()
    tb_dir = tmp_path / "tb"
    save = []
    if estimator == "ppo":  # a constant reward gives the critic non-zero returns to learn, so a restored
        # value head is told apart from a fresh (zero) one below
        (tmp_path / "one.py").write_text("async def one(args, sample):\n    return 1.0\n")
        save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--custom-rm-path", f"{tmp_path}/one.py:one"]
    cmd = _train_cmd(tiny_model_dir, toy_data_path, "--rollout-num-gpus", "1", "--global-batch-size", "16",
                     "--rm-type", "toy", "--use-tensorboard", "--tensorboard-dir", str(tb_dir), *RUNS[estimator],
                     *save)
    _train(cmd, tmp_path, 560)
    if estimator == "ppo":
        # the test checks the first run's TensorBoard folder as it was before the resume appended to it
        shutil.copytree(tb_dir, tmp_path / "tb_first_run")
        _train([*cmd, "--load", str(tmp_path / "ckpt"), "--num-rollout", "4"], tmp_path, 560)
    return tmp_path


@pytest.fixture(scope="module")
def module_runs(tiny_model_dir, toy_data_path, tmp_path_factory) -> dict:
    """The module's runs, two at a time (tests/e2e_cpu/together.py): PPO (and its resume) beside the others;
    each test checks its own run."""
    root = tmp_path_factory.mktemp("algorithms")

    def run(key):
        if key == "opsm":
            return _opsm_run(root / key, tiny_model_dir, toy_data_path)
        return _estimator_run(root / key, tiny_model_dir, toy_data_path, key)

    return run_together(run, [*RUNS, "opsm"])


@pytest.mark.timeout(1500)  # the module fixture's runs count against the first test
@pytest.mark.parametrize("estimator", list(RUNS))
def test_first_step_invariants(estimator, module_runs):
    tmp_path = result_of(module_runs, estimator)
    tb_dir = tmp_path / ("tb_first_run" if estimator == "ppo" else "tb")
    num_rollout = int(RUNS[estimator][-1])
    # --num-critic-only-steps 1: rollout 0 trains the critic only, the policy's first step is rollout 1
    first = 1 if estimator == "ppo" else 0
    steps = list(range(first, num_rollout))

    ppo_kl = read_scalars(str(tb_dir), "train/ppo_kl")
    assert sorted(ppo_kl) == steps and abs(ppo_kl[first]) < 1e-8, ppo_kl
    # KL to the reference (also reported under --kl-coef reward shaping): 0 until the policy first moves,
    # so a critic-only rollout leaves it at 0 too. The reference is a second model instance: fp32 rounding
    # differs between the two (measured ~4e-8 with k1), hence 1e-6 rather than ppo_kl's 1e-8.
    kl = read_scalars(str(tb_dir), "train/kl_loss")
    assert sorted(kl) == steps and abs(kl[first]) < 1e-6, kl
    diff = read_scalars(str(tb_dir), "train/train_rollout_logprob_abs_diff")
    assert sorted(diff) == list(range(num_rollout)) and all(v < 1e-3 for v in diff.values()), diff
    for tag in ("train/pg_loss", "train/pg_clipfrac", "train/entropy_loss", "train/grad_norm"):
        assert sorted(read_scalars(str(tb_dir), tag)) == steps, tag
    if estimator == "ppo":
        for tag in ("train/value_loss", "train/value_clipfrac", "critic/grad_norm", "critic/values"):
            assert sorted(read_scalars(str(tb_dir), tag)) == [0, 1, 2], tag
        assert read_scalars(str(tb_dir), "train/critic_only_step") == {0: 1.0}
        # a zero-initialised value head: the first values are exactly 0
        assert read_scalars(str(tb_dir), "critic/values")[0] == 0.0
        # the critic is checkpointed with the actor and resumes with it: a fresh critic's values would be 0
        critic_iter = tmp_path / "ckpt" / "critic" / "iter_0000002"
        assert (critic_iter / "value_head.pt").is_file() and (critic_iter / "model.safetensors").is_file()
        # the resumed run (the fixture's; it returned 0 and left no process behind) continued the same folder
        values = read_scalars(str(tmp_path / "tb"), "critic/values")
        assert sorted(values) == [0, 1, 2, 3] and values[3] != 0.0, values
    else:
        assert read_scalars(str(tb_dir), "train/value_loss") == {}


ENTROPY_HOOK = """
import json
import torch

def look(args, rollout_id, rollout_data):
    ent, masks = rollout_data["entropy"], rollout_data["loss_masks"]
    per_sample = [float((e * m).sum() / m.sum().clamp_min(1)) for e, m in zip(ent, masks)]
    flat = torch.cat(ent)
    with open("entropy.json", "w") as f:
        json.dump({"keys": sorted(k for k in rollout_data if k.endswith("entropy")),
                   "lengths": [len(e) for e in ent], "response_lengths": rollout_data["response_lengths"],
                   "sample_mean": sum(per_sample) / len(per_sample), "token_mean": float(flat.mean()),
                   "min": float(flat.min())}, f)
"""


def _opsm_run(tmp_path, tiny_model_dir, toy_data_path):
    tmp_path.mkdir()
    (tmp_path / "look.py").write_text(ENTROPY_HOOK)
    cmd = _train_cmd(tiny_model_dir, toy_data_path, "--rollout-num-gpus", "1", "--global-batch-size", "16",
                     "--custom-rm-path", ALTERNATING, "--use-tensorboard", "--tensorboard-dir",
                     str(tmp_path / "tb"), "--actor-num-gpus-per-node", "1", "--num-rollout", "1",
                     "--use-opsm", "--opsm-delta", "-1e9",
                     "--use-rollout-entropy", "--rollout-data-postprocess-path", f"{tmp_path}/look.py:look")
    _train(cmd, tmp_path, 280)
    return tmp_path


@pytest.mark.timeout(1500)  # the module fixture's runs count against the first test
def test_opsm_and_rollout_entropy_in_the_trainer(module_runs):
    """--use-opsm and --use-rollout-entropy through train.py (one run).

    OPSM: rewards alternate 0/1 by sample index, so every group of 4 holds two of each: GRPO advantages
    ±0.5/(std 1/√3) = ±√3/2. --opsm-delta −1e9 is below any sequence KL, so every negative-advantage sample is
    masked at the first (on-policy) step: opsm_clipfrac = 1/2 and pg_loss is the kept half's −A averaged over all
    16 samples, −√3/4 (0 without the flag).

    Rollout entropy: the old-policy pass's entropies reach --rollout-data-postprocess-path as
    rollout_data["entropy"] (one per response token); at the first step the old policy is the trained one, so
    their per-sample loss-masked mean is train/entropy_loss; rollout/entropy is their token mean."""
    tmp_path = result_of(module_runs, "opsm")
    tb_dir = tmp_path / "tb"
    clipfrac = read_scalars(str(tb_dir), "train/opsm_clipfrac")
    assert clipfrac == {0: pytest.approx(0.5)}, clipfrac
    pg_loss = read_scalars(str(tb_dir), "train/pg_loss")
    assert pg_loss == {0: pytest.approx(-(3 ** 0.5) / 4, abs=1e-4)}, pg_loss

    seen = json.loads((tmp_path / "entropy.json").read_text())
    assert seen["keys"] == ["entropy"]  # no reference model, no teacher
    assert seen["lengths"] == seen["response_lengths"] and seen["min"] >= 0.0
    entropy_loss = read_scalars(str(tb_dir), "train/entropy_loss")
    assert entropy_loss == {0: pytest.approx(seen["sample_mean"], rel=1e-5)}, (entropy_loss, seen)
    logged = read_scalars(str(tb_dir), "rollout/entropy")
    assert logged == {0: pytest.approx(seen["token_mean"], rel=1e-6)}, (logged, seen)
