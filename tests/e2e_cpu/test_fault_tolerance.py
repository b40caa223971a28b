"""--use-fault-tolerance through train.py on CPU: one of two engine servers is SIGKILLed while the run goes on.

The run must finish every rollout with every prompt group trained once, the dead engine must be taken out,
restarted and re-registered, and the rollout after the restart must be generated with the current weights by
both engines (its samples carry the version pushed just before it).
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import threading
import time

import psutil
import pytest
import torch

from slime.utils.tracking import read_scalars
from tests.e2e_cpu.test_train_e2e import _env, _train_cmd


def _engine_servers(root: psutil.Process) -> list[psutil.Process]:
    out = []
    for p in root.children(recursive=True):
        try:
            if "slime.backends.hf_engine" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.timeout(600)
def test_killed_engine_is_replaced_and_nothing_is_lost(tiny_model_dir, toy_data_path, tmp_path):
    n = 5
    dump = tmp_path / "dump"
    cmd = _train_cmd(
        tiny_model_dir, toy_data_path,
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--global-batch-size", "16",
        "--num-rollout", str(n), "--rm-type", "toy", "--rollout-max-response-len", "32",
        "--use-fault-tolerance", "--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "10",
        "--use-tensorboard", "--tensorboard-dir", str(tmp_path / "tb"),
        "--save-debug-rollout-data", str(dump / "rollout_{rollout_id}.pt"),
    )  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            cwd=str(tmp_path))
    killed: dict = {}

    def kill_one_engine_after_first_rollout():
        deadline = time.monotonic() + 400
        while not (dump / "rollout_0.pt").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        servers = _engine_servers(psutil.Process(proc.pid))
        if len(servers) == 2:
            killed["pid"] = servers[0].pid
            killed["at"] = time.time()
            os.kill(servers[0].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_one_engine_after_first_rollout, daemon=True)
    killer.start()
    out, _ = proc.communicate(timeout=560)
    killer.join(5)
    assert proc.returncode == 0, out[-4000:]
    assert "pid" in killed, "the test never found two engine servers to kill one of"

    versions, groups = {}, {}
    for path in glob.glob(str(dump / "rollout_*.pt")):
        data = torch.load(path, weights_only=False)
        versions[data["rollout_id"]] = {v for s in data["samples"] for v in s["weight_versions"]}
        groups[data["rollout_id"]] = sorted(s["group_index"] for s in data["samples"])
    assert sorted(groups) == list(range(n))
    seen = [g for k in range(n) for g in sorted(set(groups[k]))]
    assert len(seen) == len(set(seen)) == 4 * n, "a prompt group was lost or trained twice"
    assert all(groups[k] == sorted(g for g in set(groups[k]) for _ in range(4)) for k in range(n))

    restarts = read_scalars(str(tmp_path / "tb"), "rollout/engine_restarts")
    assert max(restarts.values()) == 1.0, restarts
    first_after = min(k for k, v in restarts.items() if v == 1.0)
    # the restarted engine got the push before this rollout: every sample carries that version
    assert versions[first_after] == {str(first_after + 1)}, versions
    assert "restarted at" in out
