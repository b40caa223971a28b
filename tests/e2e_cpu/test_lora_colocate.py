"""train.py --colocate with LoRA on CPU: the engines release their weights and every push sends only the adapter.

The engine runs as on CUDA (`SLIME_ENGINE_RELEASE_MEMORY_ON_CPU=1`): each release frees its weights. A LoRA run
whose engines release them starts the hf engine with `--lora-base-cpu-backup` (docs/lora.md): one host copy of the
frozen base, taken at the start-up release, brought back by every resume before the adapter push. If the base did
not come back the engine would score the samples with uninitialised memory, so the trainer/engine log-prob gap after
every push (`train/train_rollout_logprob_abs_diff`, fp32) is the check that it did; the KL to the base growing from
0 shows the adapter pushes move the policy. The fsdp trainer and the Megatron trainer (CPU shim, TP1) each run 3
rollouts; `tests/e2e_cpu/test_hf_engine_release.py` checks the engine's weights against the checkpoint after the
round trips.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess

import pytest

from slime.utils.tracking import read_scalars
from tests.conftest import model_args
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes
from tests.e2e_cpu.rewards import ALTERNATING
from tests.e2e_cpu.test_colocate_handoff import START, STEP
from tests.e2e_cpu.test_train_e2e import _env, _train_cmd

SHIM_SITE = os.path.join(os.path.dirname(__file__), "plugins", "megatron_shim")
N_ROLLOUT = 3
LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear"]
RELEASED = r"memory: released .*\(weights (\w+): ([\d.]+) GB freed\)"


def _run(tiny_model_dir, toy_data_path, tmp_path, *backend, shim: bool = False):
    before = run_processes()
    tb = tmp_path / "tb"
    logs = tmp_path / "engine_logs"
    cmd = _train_cmd(tiny_model_dir, toy_data_path, *backend, "--actor-num-gpus-per-node", "1", "--colocate",
                     "--global-batch-size", "16", "--num-rollout", str(N_ROLLOUT), "--custom-rm-path", ALTERNATING,
                     "--seed", "7", "--lr", "2e-2", "--use-kl-loss", "--kl-loss-coef", "0.01",
                     "--kl-loss-type", "low_var_kl", *LORA, "--use-tensorboard", "--tensorboard-dir", str(tb))
    env = dict(_env(), SLIME_ENGINE_LOG_DIR=str(logs), SLIME_ENGINE_RELEASE_MEMORY_ON_CPU="1")
    if shim:
        env["PYTHONPATH"] = os.pathsep.join([SHIM_SITE, env["PYTHONPATH"]])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=540)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert wait_for_no_new_processes(before) == {}
    return out, str(tb), logs


def _check(out: str, tb: str, logs) -> None:
    calls = re.findall(r"memory handoff: (.+)", out)
    assert calls == START + STEP * N_ROLLOUT, calls
    diffs = read_scalars(tb, "train/train_rollout_logprob_abs_diff")
    kl = read_scalars(tb, "train/kl_loss")
    print("abs diff", diffs, "kl", kl)
    assert sorted(diffs) == list(range(N_ROLLOUT)) and max(diffs.values()) < 1e-5, diffs  # every push: base + adapter
    assert kl[0] == 0.0 and kl[N_ROLLOUT - 1] > 0, kl  # rollout 0 is the base (B = 0); the pushed adapters moved it
    engine_log = "".join(open(f, errors="replace").read() for f in glob.glob(os.path.join(logs, "hf-engine-*.log")))
    released = re.findall(RELEASED, engine_log)
    assert len(released) == 1 + N_ROLLOUT, engine_log[-4000:]  # start-up and every step
    assert all(mode == "base_backup" and float(gb) > 0 for mode, gb in released), released  # freed, as on CUDA
    copies = re.findall(r"weights: host copy of the base taken", engine_log)
    assert len(copies) == 1, copies  # once: the base is frozen
    print(released[0], copies)


@pytest.mark.timeout(600)
def test_colocated_fsdp_lora_pushes_only_the_adapter(tiny_model_dir, toy_data_path, tmp_path):
    _check(*_run(tiny_model_dir, toy_data_path, tmp_path, "--train-backend", "fsdp"))


@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_colocated_megatron_lora_pushes_only_the_adapter(tiny_model_dir, toy_data_path, tmp_path):
    _check(*_run(tiny_model_dir, toy_data_path, tmp_path, "--train-backend", "megatron", *model_args("tiny-qwen3"),
                 "--transformer-impl", "local", shim=True))
