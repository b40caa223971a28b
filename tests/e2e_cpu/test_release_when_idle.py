"""The rollout manager releases engine memory only from idle engines (SGLang's scheduler asserts it is idle and its
server dies; the hf engine refuses with HTTP 409), whatever else runs: a real RolloutManager actor, the real
sglang-router and real hf engine servers, the calls train.py's colocated handoff makes (slime/ray/handoff.py).

- Fault tolerance's health monitor probing every millisecond: each probe is a one-token generation, so a release
  that does not wait for the probe in flight lands on a busy engine (before the fix about 45% of releases here
  were refused).
  Then the engine's server dies after a rollout: the release finds it dead and skips it, the push's
  `before_weight_update` restarts it, and generation works again.
- A background rollout (the fully async one) keeps groups in flight after a rollout returns: the release pauses
  it first, and it resumes only once the engines have their memory back, with the version pushed meanwhile.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest
import ray

from slime.config.arguments import parse_args
from slime.ray.rollout import RolloutManager

RELEASES = 12  # without waiting for the probe, ~45% of releases met one on CPU: all 12 passing is a 1e-3 chance


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _args(model: str, data: str, *extra: str):
    return parse_args([
        "--hf-checkpoint", model, "--rollout-backend", "hf", "--actor-num-gpus-per-node", "1",
        "--prompt-data", data, "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--rm-type", "toy", "--num-rollout", "2", "--sglang-server-concurrency", "8", *extra,
    ])  # fmt: skip


def _loads(urls: list[str]) -> list[int]:
    return [httpx.get(u + "/get_load", timeout=10).json()[0]["num_reqs"] for u in urls]


def _released(urls: list[str]) -> list[list[str]]:
    return [httpx.get(u + "/server_info", timeout=10).json()["released_tags"] for u in urls]


def _server_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    [pid] = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    return pid


@pytest.mark.timeout(300)
def test_release_waits_for_the_health_probe_in_flight(tiny_model_dir, toy_data_path, ray_cluster):
    args = _args(tiny_model_dir, toy_data_path, "--rollout-num-gpus", "1", "--rollout-max-response-len", "8",
                 "--use-fault-tolerance", "--rollout-health-check-interval", "0.001",
                 "--rollout-health-check-timeout", "10")
    manager = ray.remote(num_cpus=0)(RolloutManager).remote(args, None)
    try:
        [url] = ray.get(manager.get_engine_urls.remote())
        ray.get(manager.generate.remote(0))
        for _ in range(RELEASES):  # the handoff's calls, with the monitor probing in between
            time.sleep(0.3)  # the release lands at any point of a probe (a tight loop lands right after one)
            ray.get(manager.offload.remote())
            assert _released([url]) == [["cuda_graph", "kv_cache", "weights"]]
            ray.get(manager.onload_weights.remote())
            ray.get(manager.onload_kv.remote())
            assert _released([url]) == [[]]
        served = httpx.get(url + "/server_info", timeout=10).json()["num_finished_requests"]
        assert served > RELEASES, served  # the monitor did probe (with generations) between the releases

        os.kill(_server_pid(url), signal.SIGKILL)  # dies after a rollout, as train.py goes on to release
        ray.get(manager.offload.remote())  # found dead (GET /health) and skipped: it holds nothing
        ray.get(manager.onload_weights.remote())
        ray.get(manager.before_weight_update.remote())  # restarts it: a fresh server holding all its memory
        ray.get(manager.after_weight_update.remote(1))
        ray.get(manager.onload_kv.remote())
        [restarted] = ray.get(manager.get_engine_urls.remote())
        assert restarted != url and _released([restarted]) == [[]]
        batch, metrics = ray.get(manager.generate.remote(1))
        assert len(batch) == 4 and metrics["rollout/engine_restarts"] == 1.0
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
        ray.kill(manager)


@pytest.mark.timeout(300)
def test_release_pauses_a_background_rollout_until_memory_is_back(tiny_model_dir, toy_data_path, ray_cluster):
    args = _args(tiny_model_dir, toy_data_path, "--rollout-num-gpus", "1", "--rollout-max-response-len", "128",
                 "--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
                 "--over-sampling-batch-size", "4", "--async-buffer-size", "100000")
    # The worker stops launching once --async-buffer-size x --rollout-batch-size groups wait to be collected (rightly).
    # It finishes ~14 groups/s here: with 4 rollouts (8 groups) a test process slowed by CI's load let the buffer fill
    # before the release, and nothing was left to relaunch. 200,000 groups cannot fill within the test's 300 s.
    manager = ray.remote(num_cpus=0)(RolloutManager).remote(args, None)
    try:
        [url] = ray.get(manager.get_engine_urls.remote())
        batch, _ = ray.get(manager.generate.remote(0))
        assert len(batch) == 4
        deadline = time.monotonic() + 30
        while (load := _loads([url])) == [0] and time.monotonic() < deadline:  # the worker keeps groups generating
            time.sleep(0.01)
        assert load != [0]
        ray.get(manager.offload.remote())  # colocated train.py: right after the rollout
        assert _released([url]) == [["cuda_graph", "kv_cache", "weights"]] and _loads([url]) == [0]
        ray.get(manager.onload_weights.remote())
        ray.get(manager.before_weight_update.remote())
        ray.get(manager.after_weight_update.remote(1))  # the KV cache is still released: the worker must wait
        time.sleep(0.5)
        assert _loads([url]) == [0]
        ray.get(manager.onload_kv.remote())
        deadline = time.monotonic() + 30
        while (load := _loads([url])) == [0] and time.monotonic() < deadline:  # now it generates again
            time.sleep(0.02)
        assert load != [0]
        batch, _ = ray.get(manager.generate.remote(1))
        assert len(batch) == 4
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
        ray.kill(manager)
