"""Memory is released only from an idle engine: the hf engine refuses a release while it serves requests (SGLang's
scheduler asserts there and its server dies), and `ServerEngine.wait_idle` waits for the requests to finish.

A real hf engine server process, driven over HTTP: a long generation in flight (or waiting while generation is
paused) makes `/release_memory_occupation` answer 409 with the counts and nothing released; once it is over the
release goes through.

The engine runs tests/e2e_cpu/plugins/engine_fault/sitecustomize.py in its `hold` mode: while the test holds (a file
exists) its decode steps decode nothing, so a request stays running, not paused, through every check made while it
should run, however slow a loaded CI machine is; the test then lets it go and it is served to the end.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from slime.backends.hf_engine.engine import HFEngine
from slime.backends.server_engine import EngineHTTPError, EngineNotIdleError
from tests.args import make_args
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.test_engine_death import FAULT_SITE

SEQ = [56, 62, 137, 92, 138, 20, 21, 22, 23, 24, 25]
LONG = {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0.0}}


class Hold:
    """The engine's decode steps decode nothing between `on()` and `off()` (the fault plugin's hold mode)."""

    def __init__(self, path: str):
        self.path = path

    def on(self) -> None:
        open(self.path, "w").close()

    def off(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


@pytest.fixture(scope="module")
def hold_file(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("engine_hold") / "hold")


@pytest.fixture(scope="module")
def engine(tiny_model_dir, hold_file):
    eng = HFEngine(make_args(hf_checkpoint=tiny_model_dir, rollout_seed=1, sglang_server_concurrency=8), rank=0)
    try:
        with pytest.MonkeyPatch.context() as mp:  # the server's environment (ServerEngine.launch_env: os.environ)
            path = (FAULT_SITE, REPO_ROOT, os.environ.get("PYTHONPATH"))
            mp.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
            mp.setenv("SLIME_TEST_ENGINE_FAULT", f"hold:{hold_file}")
            eng.init()
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture
def hold(hold_file):
    h = Hold(hold_file)
    try:
        yield h
    finally:
        h.off()  # a failed test does not leave the next one's requests held


def _in_flight(url: str) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        box["resp"] = httpx.post(url + "/generate", json=LONG, timeout=300)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _wait_load(engine, reqs: int, timeout: float = 30.0) -> None:
    """Until `reqs` requests run (none waiting: a request is first counted while it waits to be admitted)."""
    deadline = time.monotonic() + timeout
    while (engine.get_load()[0]["num_reqs"], engine.get_load()[0]["num_waiting_reqs"]) != (reqs, 0):
        assert time.monotonic() < deadline, engine.get_load()
        time.sleep(0.02)


def _released(engine) -> list[str]:
    return engine.get_server_info()["released_tags"]


@pytest.mark.timeout(180)
def test_release_is_refused_while_a_request_runs_and_changes_nothing(engine, hold):
    url = engine.get_url()
    generated = engine.get_server_info()["num_generated_tokens"]
    hold.on()  # the request runs until hold.off(), however long the checks below take
    t, box = _in_flight(url)
    _wait_load(engine, 1)
    load = engine.get_load()
    assert load == [{**load[0], "dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0}]  # SGLang's shape
    with pytest.raises(EngineHTTPError) as e:
        engine.release_memory_occupation()
    msg = str(e.value)
    assert "HTTP 409" in msg and "1 request(s) running and 0 waiting" in msg and "abort_request" in msg, msg
    assert _released(engine) == []  # nothing was released
    assert not engine.get_server_info()["paused"]  # and generation was not paused: the request goes on
    with pytest.raises(EngineNotIdleError) as e:
        engine.wait_idle(timeout=0.5)
    msg = str(e.value)
    assert "dp rank 0: 1 request(s)" in msg and engine.log_path in msg and "$ " in msg, msg  # the log's tail
    assert t.is_alive() and engine.get_load()[0]["num_reqs"] == 1  # still running through all of the above
    assert engine.get_server_info()["num_generated_tokens"] - generated <= 1  # held: only its prefill's token
    hold.off()
    t.join(240)
    assert box["resp"].status_code == 200
    assert len(box["resp"].json()["output_ids"]) == 1000  # served to the end, untouched by the refusal
    engine.wait_idle(timeout=10)
    engine.release_memory_occupation()
    assert _released(engine) == ["cuda_graph", "kv_cache", "weights"]
    engine.resume_memory_occupation()
    assert _released(engine) == []


@pytest.mark.timeout(180)
def test_requests_paused_in_place_count_as_work(engine, hold):
    """SGLang keeps requests paused in place in its running batch, so its release asserts: refused here too."""
    url = engine.get_url()
    hold.on()  # running until it is aborted: it cannot finish before the pause
    t, box = _in_flight(url)
    _wait_load(engine, 1)
    assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30).status_code == 200
    try:
        with pytest.raises(EngineHTTPError, match=r"1 request\(s\) running and 0 waiting \(generation is paused"):
            engine.release_memory_occupation(["kv_cache"])
        assert _released(engine) == [] and engine.get_load()[0]["num_reqs"] == 1
    finally:
        engine.continue_generation()
    engine.abort_all()
    t.join(60)
    hold.off()
    assert box["resp"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    engine.wait_idle(timeout=10)
    engine.release_memory_occupation(["kv_cache"])
    engine.resume_memory_occupation(["kv_cache"])


@pytest.mark.timeout(180)
def test_wait_idle_returns_once_the_requests_left_are_done(engine, hold):
    url = engine.get_url()
    short = {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    box: dict = {}
    hold.on()  # the request runs until hold.off()
    t = threading.Thread(target=lambda: box.update(r=httpx.post(url + "/generate", json=short, timeout=120)))
    t.start()
    _wait_load(engine, 1)
    idle: dict = {}

    def wait():
        started = time.monotonic()
        try:
            engine.wait_idle(timeout=120)
        except Exception as e:  # noqa: BLE001 (reported by the assertion below)
            idle["error"] = e
        idle["waited"] = time.monotonic() - started

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive(), idle  # it waits while the generation runs
    hold.off()
    waiter.join(60)
    assert not waiter.is_alive() and "error" not in idle, idle  # and returns once it is done
    engine.release_memory_occupation()  # idle now: accepted
    engine.resume_memory_occupation()
    t.join(60)
    assert box["r"].status_code == 200 and len(box["r"].json()["output_ids"]) == 400
    assert idle["waited"] > 0.5, idle  # it did wait for the generation (held 0.5 s, then 399 decode steps)
