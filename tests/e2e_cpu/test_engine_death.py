"""An engine that fails says why in one line, wherever it fails: real hf engine servers, the real sglang-router,
the RolloutManager as a real Ray actor.

- at start-up: a model folder whose weights file is corrupt; the server exits with code 1;
- a control call (a release, a weight push by handles or by broadcast) to a server that was SIGKILLed;
- mid-rollout, with tests/e2e_cpu/plugins/engine_fault/sitecustomize.py making the engine's decode steps fail as a
  CUDA out-of-memory does (the hf engine logs it and keeps running), or fail and then get SIGKILLed.

Each time the first line of the error names the engine (rank, URL), how its process ended, its own log's telling
line and the fix; the router's answer (HTTP 503 no_available_workers, connection refused) is not the headline.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

import pytest
import ray
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from slime.backends.hf_engine.engine import HFEngine  # noqa: E402
from slime.backends.server_engine import EngineDiedError  # noqa: E402
from slime.ray.rollout import RolloutManager  # noqa: E402
from slime.weight_sync.push import BroadcastGroup, send_bucket  # noqa: E402
from tests.args import make_args  # noqa: E402
from tests.e2e_cpu.test_rollout_manager import wait_no_servers  # noqa: E402
from tests.e2e_cpu.test_rollout_manager import make_args as manager_args  # noqa: E402
from tests.e2e_cpu.test_rollout_manager import workdir  # noqa: E402, F401 (a module fixture, shared)

FAULT_SITE = os.path.join(ROOT, "tests", "e2e_cpu", "plugins", "engine_fault")
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 36.00 GiB. GPU 0 has a total capacity of 139.81"


def first_line(error: BaseException) -> str:
    return str(error).splitlines()[0]


def kill_server(engine: HFEngine) -> None:
    os.kill(engine.process.pid, signal.SIGKILL)
    engine.process.wait(10)


@pytest.fixture
def engine(workdir):  # noqa: F811
    eng = HFEngine(make_args(hf_checkpoint=workdir["model"]), rank=0)
    try:
        eng.init()
        yield eng
    finally:
        eng.shutdown()


@pytest.mark.timeout(180)
def test_start_up_failure_names_the_engine_its_exit_and_the_logged_cause(workdir, tmp_path):  # noqa: F811
    broken = shutil.copytree(workdir["model"], tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    eng = HFEngine(make_args(hf_checkpoint=str(broken)), rank=0)
    with pytest.raises(RuntimeError) as info:
        eng.init()
    line = first_line(info.value)
    assert line.startswith("hf-engine rank 0 (http://") and "exited with code 1 at start-up, before answering" in line
    assert "SafetensorError: Error while deserializing header" in line, line
    assert line.endswith(f"Log: {eng.log_path}")
    assert "Traceback (most recent call last)" in str(info.value)  # the log's tail follows the line
    assert eng.process is None  # reaped


@pytest.mark.timeout(180)
def test_control_calls_to_a_killed_server_report_its_death(engine):
    assert engine.death_report() is None and engine.status() == {"alive": True, "report": None}
    kill_server(engine)
    report = engine.death_report()
    assert report.startswith(f"hf-engine rank 0 ({engine.get_url()}) was killed by SIGKILL: its log shows no error. "
                             "Fix: SIGKILL with no error in the log: the kernel's OOM killer")
    assert report.endswith(f"Log: {engine.log_path}")
    with pytest.raises(EngineDiedError) as info:
        engine.release_memory_occupation(["kv_cache"])
    assert first_line(info.value) == report
    assert "POST" in str(info.value) and "/release_memory_occupation failed: ConnectError" in str(info.value)
    with pytest.raises(EngineDiedError) as info:  # a weight push by handles (the colocated route)
        send_bucket([("lm_head.weight", torch.zeros(4, 4))], [engine], "1")
    assert first_line(info.value) == report


@pytest.mark.timeout(180)
def test_a_broadcast_to_an_engine_that_died_reports_the_death(engine):
    group = BroadcastGroup([engine], "gloo", group_name="death_test")
    try:
        kill_server(engine)
        with pytest.raises(EngineDiedError) as info:
            group.send([("lm_head.weight", torch.zeros(4, 4))], "1")
        assert "was killed by SIGKILL" in first_line(info.value)
        assert first_line(info.value).startswith(f"hf-engine rank 0 ({engine.get_url()})")
    finally:
        from slime.weight_sync.group import destroy_weight_update_group

        destroy_weight_update_group(group.pg)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def failing_manager(workdir, fault: str, *extra: str):  # noqa: F811
    """A RolloutManager with one engine whose server runs the fault hook $SLIME_TEST_ENGINE_FAULT=`fault`."""
    args = manager_args(workdir, "--rollout-num-gpus", "1", "--rollout-max-response-len", "8", *extra)
    path = os.pathsep.join(filter(None, [FAULT_SITE, ROOT, os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "SLIME_TEST_ENGINE_FAULT": fault}
    return ray.remote(num_cpus=0, runtime_env={"env_vars": env})(RolloutManager).remote(args, None)


def rollout_error(manager) -> BaseException:
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(manager.generate.remote(0), timeout=300)
    return info.value.cause


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode,state", [("raise", "is running but logged an error"),
                                        ("die", "was killed by SIGKILL")])
def test_a_rollout_whose_engine_fails_names_the_engine_and_its_cause(workdir, ray_cluster, mode, state):  # noqa: F811
    manager = failing_manager(workdir, f"{mode}:2")
    try:
        [url] = ray.get(manager.get_engine_urls.remote())
        error = rollout_error(manager)
        line = first_line(error)
        assert line.startswith(f"rollout 0 failed: hf-engine rank 0 ({url}) {state}: {OOM}"), str(error)
        assert "Fix: the engine ran out of GPU memory" in line and "--sglang-server-concurrency" in line
        log_path = line.rsplit("Log: ", 1)[1]
        with open(log_path) as f:
            assert "engine step failed" in f.read()  # the line is the engine's own, from its log
        assert "503" not in line and "HTTPRequestError" not in line
        # the rollout's own failure (the router's or the client's answer) is still there, below
        assert any(x.startswith("the rollout's own error: RuntimeError: rollout 0: ") for x in str(error).splitlines())
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
        ray.kill(manager)
    assert not wait_no_servers(), "servers left after shutdown"


@pytest.mark.timeout(420)
def test_a_rollout_that_tolerates_its_failures_still_stops_on_a_dead_engine(workdir, ray_cluster):  # noqa: F811
    """--max-failed-ratio 1.0: the rollout itself returns (every sample FAILED), but without --use-fault-tolerance
    nothing would restart the dead engine: the manager raises with its line instead of training on nothing."""
    manager = failing_manager(workdir, "die:2", "--max-failed-ratio", "1.0")
    try:
        [url] = ray.get(manager.get_engine_urls.remote())
        error = rollout_error(manager)
        lines = str(error).splitlines()
        assert lines[0].startswith(f"rollout 0: hf-engine rank 0 ({url}) was killed by SIGKILL: {OOM}"), str(error)
        assert lines[1] == "(without --use-fault-tolerance a dead engine is not restarted: the run cannot go on)"
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
        ray.kill(manager)
    assert not wait_no_servers(), "servers left after shutdown"


@pytest.mark.timeout(60)
def test_the_fault_hook_does_nothing_outside_an_engine_server():
    """The hook only touches a process started as `python -m slime.backends.hf_engine` with the variable set."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAULT_SITE, ROOT]), SLIME_TEST_ENGINE_FAULT="raise:0")
    code = "import sys; print('slime.backends.hf_engine.scheduler' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
