"""`RouterProcess` against the real sglang-router 0.3.2 and two real hf engine servers (no Ray)."""

import os
import subprocess
import sys
import time

import httpx
import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from slime.backends.hf_engine.engine import HFEngine  # noqa: E402
from slime.rollout.router import RouterProcess  # noqa: E402
from tests.args import make_args  # noqa: E402

PROMPT = [56, 62, 137, 92]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), size="tiny", seed=0)


@pytest.fixture(scope="module")
def engines(tiny_model):
    engs = [HFEngine(make_args(hf_checkpoint=tiny_model, rollout_seed=0), rank=i) for i in range(2)]
    try:
        for e in engs:  # from this thread: PDEATHSIG ties each server to the thread that started it
            e.init()
        yield engs
    finally:
        for e in engs:
            e.shutdown()


def _finished(engine) -> int:
    return engine.get_server_info()["num_finished_requests"]


def _generate(url: str) -> dict:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True}}  # fmt: skip
    resp = httpx.post(url + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.timeout(120)
def test_register_round_robin_deregister_stop(engines, tmp_path):
    router = RouterProcess("127.0.0.1", None, log_dir=str(tmp_path))
    router.start()
    pid = router.pid
    try:
        assert psutil.Process(pid).is_running() and router.list_workers() == []
        urls = [e.get_url() for e in engines]
        ids = [router.add_worker(u) for u in urls]
        assert all(ids) and len(set(ids)) == 2
        assert sorted(router.list_workers()) == sorted(urls)
        assert router.add_worker(urls[0]) == ids[0]  # adding again is a no-op with the same id

        before = [_finished(e) for e in engines]
        outs = [_generate(router.url) for _ in range(6)]
        assert all(len(o["output_ids"]) == 3 and len(o["meta_info"]["output_token_logprobs"]) == 3 for o in outs)
        assert [_finished(e) - b for e, b in zip(engines, before)] == [3, 3]  # round robin spreads evenly

        assert router.remove_worker(urls[0]) is True
        assert router.list_workers() == [urls[1]]
        assert router.remove_worker(urls[0]) is False
        before = [_finished(e) for e in engines]
        for _ in range(2):
            _generate(router.url)
        assert [_finished(e) - b for e, b in zip(engines, before)] == [0, 2]

        with pytest.raises(TimeoutError, match="job status"):
            router.add_worker("http://127.0.0.1:9", timeout=2)  # nothing listens there
    finally:
        router.stop()
    router.stop()  # idempotent
    assert _gone(pid) and router.pid is None
    with pytest.raises(httpx.TransportError):
        httpx.get(router.url + "/health", timeout=2)


@pytest.mark.timeout(60)
def test_bad_router_flag_fails_with_log_tail(tmp_path):
    router = RouterProcess("127.0.0.1", None, extra_args={"no_such_flag": 1}, log_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="(?s)exited with code.*unrecognized arguments: --no-such-flag 1"):
        router.start()
    assert router.pid is None


@pytest.mark.timeout(60)
def test_router_dies_with_its_owner(tmp_path):
    """PR_SET_PDEATHSIG: SIGKILL the process that started the router; the router must follow."""
    script = (f"import sys; sys.path.insert(0, {ROOT!r})\n"
              "from slime.rollout.router import RouterProcess\n"
              f"r = RouterProcess('127.0.0.1', None, log_dir={str(tmp_path)!r}).start()\n"
              "print(r.pid, flush=True)\nimport time; time.sleep(600)\n")  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        router_pid = int(owner.stdout.readline())
        assert not _gone(router_pid)
    finally:
        owner.kill()
        owner.wait(10)
    assert _wait_gone(router_pid), "sglang-router outlived its owner"


@pytest.mark.timeout(60)
def test_two_routers_on_one_host(tmp_path):
    """Each router also serves Prometheus metrics (port 29000 by default); ours must not collide there."""
    first = RouterProcess("127.0.0.1", None, log_dir=str(tmp_path)).start()
    try:
        second = RouterProcess("127.0.0.1", None, log_dir=str(tmp_path)).start()
        try:
            assert first.is_alive() and second.is_alive() and first.port != second.port
        finally:
            second.stop()
    finally:
        first.stop()
