"""`SGLangEngine` launching real processes through a `sglang` command found on PATH.

SGLang itself cannot run here (no GPU), so the `sglang` on PATH is a script written by the test
(`SLIME_SGLANG_LAUNCHER="sglang serve"`, as a user would launch SGLang's CLI):
- one that fails at once, as SGLang does on a machine it cannot use: `init` must report the failure
  with the server's stderr instead of waiting for a health check that never comes;
- one that records the command line it was given and then serves the built-in hf engine on the same
  model: the engine actor's whole lifecycle (wait on /health_generate, control calls including the
  distributed weight update, shutdown reaping the process) runs against a real server.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import psutil
import pytest

from slime.backends.sglang_utils.sglang_engine import SGLangEngine
from slime.utils.net import free_port
from tests.args import make_args
from slime.weight_sync.group import (
    broadcast_tensors,
    destroy_weight_update_group,
    init_weight_update_group,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAILING = """#!/bin/sh
echo "fake sglang: RuntimeError: CUDA driver initialization failed, you might not have a CUDA gpu." >&2
exit 1
"""

SERVING = f"""#!{sys.executable}
import json, os, sys, time
argv = sys.argv[1:]
def value(flag):
    return argv[argv.index(flag) + 1]
node_rank = int(value("--node-rank")) if "--node-rank" in argv else 0
with open(os.environ["FAKE_SGLANG_ARGV"] + (f".node{{node_rank}}" if node_rank else ""), "w") as f:
    json.dump(argv, f)
with open(os.environ["FAKE_SGLANG_ARGV"] + ".env", "w") as f:
    json.dump({{k: v for k, v in os.environ.items() if k.startswith(("SGLANG_", "SGL_"))}}, f)
if node_rank:  # a follower node of a multi-node engine: SGLang's scheduler processes, no HTTP server
    time.sleep(3600)
os.execv(sys.executable, [sys.executable, "-m", "slime.backends.hf_engine", "--model-path", value("--model-path"),
                          "--host", value("--host"), "--port", value("--port"),
                          "--random-seed", value("--random-seed"), "--num-threads", "1"])
"""


def _install(tmp_path, monkeypatch, script: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = bin_dir / "sglang"
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "sglang serve")
    monkeypatch.setenv("SLIME_ENGINE_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def _args(model, **kw):
    base = {"hf_checkpoint": model, "rollout_num_gpus_per_engine": 1, "num_gpus_per_node": 8, "seed": 5,
            "colocate": False, "offload_rollout": False,
            "sglang_args": {"mem_fraction_static": 0.7, "log_level": "warning"}}
    return make_args(validate=False, **{**base, **kw})


@pytest.mark.timeout(120)
def test_launch_failure_reports_stderr_without_hanging(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, FAILING)
    eng = SGLangEngine(_args(str(tmp_path / "no-model")), rank=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        eng.init()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "exited with code 1" in message and "CUDA driver initialization failed" in message
    assert "sglang serve --model-path" in message  # the log quotes the command it ran
    assert elapsed < eng.startup_timeout_s / 10, f"took {elapsed:.0f} s to notice the exit"
    assert eng.process is None


def _in_thread(fn, *args, **kwargs):
    out = {}
    t = threading.Thread(target=lambda: out.update(value=fn(*args, **kwargs)), daemon=True)
    t.start()
    return t, out


@pytest.mark.timeout(240)
def test_engine_lifecycle_behind_the_sglang_command(tmp_path, monkeypatch, tiny_model_dir):
    from safetensors.torch import load_file

    _install(tmp_path, monkeypatch, SERVING)
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_SGLANG_ARGV", str(argv_file))
    monkeypatch.setenv("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "true")  # the user's setting wins over slime's default
    eng = SGLangEngine(_args(tiny_model_dir), rank=2)
    try:
        url = eng.init()
        assert url == eng.get_url()
        argv = json.loads(argv_file.read_text())
        assert argv[0] == "serve"
        def flag(name):
            return argv[argv.index(name) + 1]

        assert flag("--model-path") == tiny_model_dir and flag("--tp-size") == "1"
        assert flag("--random-seed") == "7" and flag("--port") == str(eng.port)
        assert flag("--mem-fraction-static") == "0.7" and flag("--log-level") == "warning"
        assert int(flag("--nccl-port")) != eng.port
        assert "--skip-server-warmup" in argv and "--trust-remote-code" in argv
        assert "--enable-memory-saver" not in argv
        env = json.loads((tmp_path / "argv.json.env").read_text())  # slime's server environment
        assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"  # /health must not generate
        assert env["SGLANG_VLM_CACHE_SIZE_MB"] == "0"  # no vision-tower outputs kept across weight pushes
        assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in env and env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "true"
        assert eng.health_generate(timeout=30)

        # The distributed weight update through the actor's methods; this test is the trainer (rank 0).
        name = "lm_head.weight"
        new = load_file(os.path.join(tiny_model_dir, "model.safetensors"))[name] * 0 + 0.01
        port = free_port("127.0.0.1")
        t, out = _in_thread(eng.init_weights_update_group, "127.0.0.1", port, 1, 2, "lifecycle", "gloo")
        pg = init_weight_update_group("127.0.0.1", port, 0, 2, "lifecycle", "gloo", timeout_s=120)
        try:
            t.join(120)
            assert out["value"]["success"]
            t, out = _in_thread(eng.update_weights_from_distributed, [name], [new.dtype], [new.shape], "lifecycle",
                                weight_version="7")
            broadcast_tensors(pg, [new])
            t.join(120)
            assert out["value"]["weight_version"] == "7" and eng.get_weight_version() == "7"
        finally:
            eng.destroy_weights_update_group("lifecycle")
            destroy_weight_update_group(pg)

        eng.pause_generation()
        eng.continue_generation()
        eng.release_memory_occupation(["weights", "kv_cache"])
        eng.resume_memory_occupation(["weights", "kv_cache"])
        eng.flush_cache()
        assert eng.health_generate(timeout=30)
        pid = eng.process.pid
    finally:
        eng.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(240)
def engine_pids() -> list[int]:
    """Engine server processes (hf engine or the stand-in SGLang launcher) below this test process; a child that
    exits while we look (or is a zombie not yet reaped by its parent) is not an engine."""
    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if any(s in cmdline for s in ("slime.backends.hf_engine", "bin/sglang")):
            pids.append(p.pid)
    return pids


def test_multi_node_engine_gets_one_actor_per_node(tmp_path, monkeypatch, tiny_model_dir):
    """An engine twice as wide as a node: the RolloutManager starts two actors on their own bundles,
    node rank 1 told node rank 0's rendezvous address, one URL registered, both servers reaped."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from slime.ray.rollout import RolloutManager
    from slime.rollout.router import RouterClient
    from slime.config.arguments import parse_args

    _install(tmp_path, monkeypatch, SERVING)
    argv_file = tmp_path / "argv.json"
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1 =", "label": "2"}) + "\n")
    args = parse_args([
        "--hf-checkpoint", tiny_model_dir, "--rollout-backend", "hf",
        "--prompt-data", str(data), "--input-key", "prompt",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
        "--num-gpus-per-node", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
        "--global-batch-size", "2", "--rollout-max-response-len", "4", "--rm-type", "math", "--num-rollout", "1",
    ])  # fmt: skip
    # parse_args allows --rollout-backend sglang only with CUDA; the launcher on PATH stands in for SGLang
    args.rollout_backend = "sglang"
    env = {k: os.environ[k] for k in ("PATH", "SLIME_SGLANG_LAUNCHER", "SLIME_ENGINE_LOG_DIR", "PYTHONPATH")}
    env["FAKE_SGLANG_ARGV"] = str(argv_file)
    before = engine_pids()  # engines of other tests in this session (the contract suite's) are not this test's
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    try:
        ray.get(pg.ready())
        manager = ray.remote(num_cpus=0)(RolloutManager).remote(args, (pg, [0, 1]))
        try:
            [url] = ray.get(manager.get_engine_urls.remote(), timeout=180)
            assert len(ray.get(manager.get_engines.remote())) == 1
            assert RouterClient(ray.get(manager.get_router_url.remote())).list_workers() == [url]
            leader = json.loads(argv_file.read_text())
            follower = json.loads((tmp_path / "argv.json.node1").read_text())

            def flag(argv, name):
                return argv[argv.index(name) + 1]

            assert flag(leader, "--dist-init-addr") == flag(follower, "--dist-init-addr")
            assert [flag(a, "--nnodes") for a in (leader, follower)] == ["2", "2"]
            assert [flag(a, "--node-rank") for a in (leader, follower)] == ["0", "1"]
            assert flag(leader, "--tp-size") == flag(follower, "--tp-size") == "2"
            batch, _ = ray.get(manager.generate.remote(0), timeout=120)
            assert len(batch) == 2
            pids = [p for p in engine_pids() if p not in before]
            assert len(pids) == 2, pids  # node rank 0's server (hf engine) and node rank 1's
        finally:
            ray.get(manager.shutdown.remote(), timeout=120)
            ray.kill(manager)
    finally:
        remove_placement_group(pg)
        ray.shutdown()
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "a node's server outlived the shutdown"
        time.sleep(0.2)


@pytest.mark.timeout(60)
def test_a_server_killed_as_it_fails_a_check_is_reported_killed_not_running(tmp_path):
    """The health monitor takes an engine out as soon as its server stops answering, which on a busy machine can be
    before the SIGKILLed process is reapable: `failure_report(settle_s=...)` (the take-out's question) waits for the
    exit and names the signal, where an immediate look may still see a running server; a server that keeps running
    is reported as such (None) after the wait."""
    eng = SGLangEngine(_args(str(tmp_path / "model")), rank=0)
    eng.log_path = str(tmp_path / "server.log")
    eng.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        assert eng.failure_report(settle_s=0.5) is None  # alive: the wait ends with nothing to report
        assert time.monotonic() - start >= 0.5
        os.kill(eng.process.pid, signal.SIGKILL)
        report = eng.failure_report(settle_s=10)
        assert report is not None and "was killed by SIGKILL" in report, report
    finally:
        eng.process.kill()
        eng.process.wait()
