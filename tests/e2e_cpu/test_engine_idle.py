"""Memory is released only from an idle engine: the hf engine refuses a release while it serves requests (SGLang's
scheduler asserts there and its server dies), and `ServerEngine.wait_idle` waits for the requests to finish.

A real hf engine server process, driven over HTTP: a long generation in flight (or waiting while generation is
paused) makes `/release_memory_occupation` answer 409 with the counts and nothing released; once it is over the
release goes through.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from slime.backends.hf_engine.engine import HFEngine
from slime.backends.server_engine import EngineHTTPError, EngineNotIdleError
from tests.args import make_args

SEQ = [56, 62, 137, 92, 138, 20, 21, 22, 23, 24, 25]
LONG = {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0.0}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = HFEngine(make_args(hf_checkpoint=tiny_model_dir, rollout_seed=1, sglang_server_concurrency=8), rank=0)
    try:
        eng.init()
        yield eng
    finally:
        eng.shutdown()


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
def test_release_is_refused_while_a_request_runs_and_changes_nothing(engine):
    url = engine.get_url()
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
    t.join(240)
    assert box["resp"].status_code == 200
    assert len(box["resp"].json()["output_ids"]) == 1000  # served to the end, untouched by the refusal
    engine.wait_idle(timeout=10)
    engine.release_memory_occupation()
    assert _released(engine) == ["cuda_graph", "kv_cache", "weights"]
    engine.resume_memory_occupation()
    assert _released(engine) == []


@pytest.mark.timeout(180)
def test_requests_paused_in_place_count_as_work(engine):
    """SGLang keeps requests paused in place in its running batch, so its release asserts: refused here too."""
    url = engine.get_url()
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
    assert box["resp"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    engine.wait_idle(timeout=10)
    engine.release_memory_occupation(["kv_cache"])
    engine.resume_memory_occupation(["kv_cache"])


@pytest.mark.timeout(180)
def test_wait_idle_returns_once_the_requests_left_are_done(engine):
    url = engine.get_url()
    short = {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=httpx.post(url + "/generate", json=short, timeout=120)))
    t.start()
    _wait_load(engine, 1)
    started = time.monotonic()
    engine.wait_idle(timeout=120)
    waited = time.monotonic() - started
    engine.release_memory_occupation()  # idle now: accepted
    engine.resume_memory_occupation()
    t.join(60)
    assert box["r"].status_code == 200 and len(box["r"].json()["output_ids"]) == 400
    assert waited > 0.2, waited  # it did wait for the generation (400 tokens take longer than that here)
