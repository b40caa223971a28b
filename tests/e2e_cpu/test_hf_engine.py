"""The hf engine as a real server process (started by `HFEngine`), alone and behind the real sglang-router."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from slime.backends.hf_engine.engine import HFEngine
from slime.backends.server_engine import EngineHTTPError
from slime.utils.net import free_port
from slime.weight_sync.buckets import buckets
from slime.weight_sync.tensor_payload import flatten_bucket, serialize_bucket
from tests.args import make_args

SEQ = [56, 62, 137, 92, 138, 20, 21, 22, 23, 24, 25]
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), size="tiny", seed=0)


@pytest.fixture(scope="module")
def engine(tiny_model):
    args = make_args(hf_checkpoint=tiny_model, rollout_seed=1, sglang_server_concurrency=16)
    eng = HFEngine(args, rank=0)
    try:
        eng.init()
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def generate(url, timeout=60.0, **body):
    resp = httpx.post(url + "/generate", json=body, timeout=timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()


def score(url, ids):
    out = generate(url, input_ids=ids, sampling_params={"max_new_tokens": 0, "temperature": 1.0},
                   return_logprob=True, logprob_start_len=0)
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]], out["meta_info"]["weight_version"]


def reference_scores(model, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float()[:-1], dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


def max_diff(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def wait_for_info(engine, predicate, what, timeout=60.0):
    """Poll /server_info until `predicate(info)` holds; returns that info (the deadline only matters on failure)."""
    deadline = time.monotonic() + timeout
    while True:
        info = engine.get_server_info()
        if predicate(info):
            return info
        assert time.monotonic() < deadline, f"engine never reached: {what}; last /server_info: {info}"
        time.sleep(0.01)


def admitted_together(engine, n, send):
    """Pause the (idle) engine, run `send()` in a thread until its `n` requests wait in the queue, then continue:
    the scheduler admits all of them in one prefill, whatever the load (the admission quiet time of a burst,
    scheduler.ADMIT_QUIET_S, is milliseconds). Returns what `send` returned."""
    box = {}

    def worker():
        try:
            box["out"] = send()
        except BaseException as e:  # noqa: BLE001 (raised again in the test's thread)
            box["error"] = e

    engine.pause_generation()  # SGLang's default mode; nothing is in flight, so it aborts nothing
    thread = threading.Thread(target=worker)
    try:
        thread.start()
        wait_for_info(engine, lambda i: i["num_waiting_reqs"] == n or "error" in box, f"{n} requests waiting")
        assert "error" not in box and "out" not in box
    finally:
        engine.continue_generation()
        thread.join(60)
    assert not thread.is_alive(), "requests did not finish"
    if "error" in box:
        raise box["error"]
    return box["out"]


@pytest.mark.timeout(120)
def test_generate_and_info_endpoints(engine, tiny_model):
    url = engine.get_url()
    assert httpx.get(url + "/health").status_code == 200
    assert engine.health_generate(timeout=30)
    info = httpx.get(url + "/get_model_info").json()
    assert info["model_path"] == tiny_model and info["is_generation"] is True
    assert httpx.get(url + "/server_info").json()["max_running_requests"] == 16

    out = generate(url, text="what is one plus two", return_logprob=True,
                   sampling_params={"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    assert out["meta_info"]["prompt_tokens"] == 5 and out["meta_info"]["weight_version"] == "default"

    bad = httpx.post(url + "/generate", json={"input_ids": [5, 10**6]}, timeout=30)
    assert bad.status_code == 400 and "input_ids" in bad.json()["error"]["message"]


@pytest.mark.timeout(120)
def test_concurrent_requests_are_batched(engine):
    url = engine.get_url()
    params = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True}
    before = engine.get_server_info()

    def send():
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda i: generate(url, input_ids=SEQ[: 3 + i], sampling_params=params,
                                                    return_logprob=True), range(8)))

    outs = admitted_together(engine, 8, send)  # eight requests waiting together: one prefill of eight rows
    assert all(len(o["output_ids"]) == 40 for o in outs)
    after = engine.get_server_info()
    assert after["num_prefill_steps"] - before["num_prefill_steps"] == 1
    assert after["num_prefill_rows"] - before["num_prefill_rows"] == 8  # eight distinct prompts
    assert after["max_batch_size_seen"] >= 8


@pytest.mark.timeout(120)
def test_a_groups_samples_over_http_share_one_prefill(engine):
    """n concurrent requests of one prompt (how slime sends a GRPO group) are prefilled as one row; each sample
    still draws its own tokens."""
    import asyncio

    url = engine.get_url()
    before = engine.get_server_info()
    body = {"input_ids": SEQ[:9], "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}}

    async def group():  # as slime's rollout sends them: one asyncio client, all n at once
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            answers = await asyncio.gather(*(client.post(url + "/generate", json=body) for _ in range(8)))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        return [a.json() for a in answers]

    # all 8 wait while generation is paused, so they are admitted in one prefill whatever CI's load
    outs = admitted_together(engine, 8, lambda: asyncio.run(group()))
    after = engine.get_server_info()
    shared = after["num_shared_prefill_rows"] - before["num_shared_prefill_rows"]
    assert after["num_prefill_steps"] - before["num_prefill_steps"] == 1
    assert after["num_prefill_rows"] - before["num_prefill_rows"] == 1, "one row through the model"
    assert shared == 7, shared  # and its cache copied to the other 7
    assert all(len(o["output_ids"]) == 8 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


@pytest.mark.timeout(120)
def test_update_weights_from_tensor_and_disk(engine, reference, tiny_model):
    url = engine.get_url()
    before, version = score(url, SEQ)
    assert max_diff(before, reference_scores(reference, SEQ)) < TOL and version == "default"

    gen = torch.Generator().manual_seed(3)
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=gen)) for n, p in reference.named_parameters()]
    for bucket in buckets(new, max_bytes=1 << 20):
        flat = flatten_bucket(bucket)  # kept alive until the engine has copied it (shared memory)
        result = engine.update_weights_from_tensor(serialize_bucket(flat), weight_version="v1")
        assert result["success"]
    assert engine.get_weight_version() == "v1"
    after, version = score(url, SEQ)
    with torch.no_grad():
        for (name, tensor), (_, param) in zip(new, reference.named_parameters()):
            param.copy_(tensor)
    assert version == "v1" and max_diff(after, before) > 1e-3
    assert max_diff(after, reference_scores(reference, SEQ)) < TOL

    # a bucket with one unknown name is refused whole: the valid tensor next to it is not applied either
    bad = [new[0], ("model.layers.0.no_such.weight", torch.zeros(2))]
    bad[0] = (bad[0][0], torch.zeros_like(bad[0][1]))
    flat = flatten_bucket(bad)
    with pytest.raises(EngineHTTPError, match=r"no_such.*model\.") as err:
        engine.update_weights_from_tensor(serialize_bucket(flat), weight_version="v2")
    assert "model.layers.0.no_such.weight" in str(err.value)
    assert max_diff(score(url, SEQ)[0], after) == 0.0 and engine.get_weight_version() == "v1"

    # back to the checkpoint on disk, while a generation is running: it is held in place between two steps (its
    # tokens and cache kept) for the update and then finishes under the new weights
    long = {"max_new_tokens": 300, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        for _attempt in range(5):
            start = engine.get_server_info()["num_generated_tokens"]
            running = pool.submit(generate, url, input_ids=SEQ, sampling_params=long)
            wait_for_info(engine, lambda i: i["num_generated_tokens"] > start, "the generation has begun")
            engine.pause_generation("in_place")  # returns once the step under way has ended
            paused = engine.get_server_info()
            if paused["num_running_reqs"] == 1:
                break
            # it finished in the moment before the pause (a loaded machine): nothing was updated yet; again
            engine.continue_generation()
            early = running.result(60)
            assert len(early["output_ids"]) == 300 and early["meta_info"]["weight_version"] == "v1"
        else:
            pytest.fail("a 300-token generation never outlasted the round trip of a pause")
        done = paused["num_generated_tokens"] - start
        assert 0 < done < 300 and paused["num_waiting_reqs"] == 0, paused  # mid-generation
        try:
            engine.update_weights_from_disk(tiny_model, weight_version="v2")
        finally:
            engine.continue_generation()
        out = running.result(60)
    assert len(out["output_ids"]) == 300 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["weight_version"] == "v2"
    restored, version = score(url, SEQ)
    assert version == "v2" and max_diff(restored, before) < TOL


def test_update_from_disk_refuses_folders_outside_the_allowed_ones(engine, tiny_model):
    """Only the folder holding the checkpoint (and --save, SLIME_ENGINE_WEIGHT_DIRS) may be read, also
    through a symlink placed inside it."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as outside:
        shutil.copytree(tiny_model, os.path.join(outside, "copy"))
        with pytest.raises(EngineHTTPError, match="outside the folders this engine may load weights from"):
            engine.update_weights_from_disk(os.path.join(outside, "copy"), weight_version="evil")
        link = os.path.join(os.path.dirname(tiny_model), "link-outside")
        os.symlink(os.path.join(outside, "copy"), link)
        try:
            with pytest.raises(EngineHTTPError, match="outside the folders"):
                engine.update_weights_from_disk(link, weight_version="evil")
        finally:
            os.unlink(link)
    assert engine.get_weight_version() != "evil"
    resp = httpx.post(engine.get_url() + "/update_weights_from_disk", json={"model_path": "/etc"}, timeout=30)
    assert resp.status_code in (400, 403)


@pytest.mark.timeout(120)
def test_pause_abort_release(engine):
    url = engine.get_url()
    long = {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}

    engine.pause_generation()
    box = {}
    worker = threading.Thread(target=lambda: box.update(out=generate(url, **long)))
    worker.start()
    wait_for_info(engine, lambda i: i["num_waiting_reqs"] == 1, "the request waiting while paused")
    assert "out" not in box and engine.get_server_info()["num_waiting_reqs"] == 1
    assert engine.health_generate(timeout=10)  # paused on purpose is still healthy
    assert "out" not in box and engine.get_server_info()["num_waiting_reqs"] == 1
    start = engine.get_server_info()["num_generated_tokens"]
    engine.continue_generation()
    wait_for_info(engine, lambda i: i["num_generated_tokens"] > start, "the request generating after continue")
    engine.abort_all()
    worker.join(60)
    assert not worker.is_alive()
    out = box["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 1500

    engine.release_memory_occupation()
    resp = httpx.post(url + "/generate", json={"input_ids": SEQ}, timeout=30)
    assert resp.status_code == 503 and "resume_memory_occupation" in resp.json()["error"]["message"]
    engine.resume_memory_occupation()
    assert len(generate(url, input_ids=SEQ, sampling_params={"max_new_tokens": 2, "ignore_eos": True})["output_ids"]) == 2
    engine.flush_cache()


def test_idle_keep_alive_connection_is_not_closed_by_the_server(engine):
    """The engine keeps an idle keep-alive connection open past uvicorn's default 5 s, so a client (the router's
    pool) reusing it between rollouts is not answered "400 Invalid HTTP request" or reset (server.KEEP_ALIVE_S)."""
    from urllib.parse import urlparse

    url = urlparse(engine.get_url())
    request = f"GET /server_info HTTP/1.1\r\nHost: {url.hostname}\r\n\r\n".encode()

    def receive(sock) -> bytes:
        chunk = sock.recv(65536)
        assert chunk, "the engine closed the idle keep-alive connection"
        return chunk

    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        for attempt in range(2):
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data:
                data += receive(sock)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += receive(sock)
            if attempt == 0:
                time.sleep(6.5)  # idle longer than uvicorn's default keep-alive timeout


@pytest.mark.timeout(120)
def test_through_sglang_router(engine):
    port = free_port("127.0.0.1")
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                               "--port", str(port), "--policy", "round_robin", "--log-level", "warn"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(base + "/workers", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "router did not come up"
            time.sleep(0.2)
        resp = httpx.post(base + "/workers", json={"url": engine.get_url()}, timeout=10)
        assert resp.status_code in (200, 202), resp.text
        worker_id = _wait_workers(base, lambda ws: any(w["url"] == engine.get_url() for w in ws))
        out = generate(base, input_ids=SEQ[:4], return_logprob=True,
                       sampling_params={"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True,
                                        "no_stop_trim": True, "spaces_between_special_tokens": False})
        assert len(out["output_ids"]) == 5 and len(out["meta_info"]["output_token_logprobs"]) == 5
        assert httpx.delete(f"{base}/workers/{worker_id}", timeout=10).status_code in (200, 202, 204)
        _wait_workers(base, lambda ws: not ws)
    finally:
        os.killpg(router.pid, signal.SIGTERM)
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(router.pid, signal.SIGKILL)
            router.wait(10)


def _wait_workers(base, predicate):
    deadline = time.monotonic() + 30
    while True:
        workers = httpx.get(base + "/workers", timeout=5).json()["workers"]
        if predicate(workers):
            return workers[0]["id"] if workers else None
        assert time.monotonic() < deadline, f"router workers never matched: {workers}"
        time.sleep(0.2)


@pytest.mark.timeout(60)
def test_bad_checkpoint_fails_fast_with_log(tmp_path):
    eng = HFEngine(make_args(hf_checkpoint=str(tmp_path / "missing"), rollout_seed=0), rank=3)
    with pytest.raises(RuntimeError, match="exited with code") as err:
        eng.init()
    assert "missing" in str(err.value) and eng.process is None


@pytest.mark.timeout(90)
def test_server_dies_with_its_owner(tiny_model, tmp_path):
    """PR_SET_PDEATHSIG: SIGKILL the process that started the engine; the server must follow."""
    script = (f"import sys; sys.path.insert(0, {ROOT!r})\n"
              "from slime.backends.hf_engine.engine import HFEngine\n"
              "from tests.args import make_args\n"
              f"e = HFEngine(make_args(hf_checkpoint={tiny_model!r}), rank=0); e.init()\n"
              "print(e.process.pid, flush=True)\nimport time; time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(owner.stdout.readline())
        assert psutil.pid_exists(server_pid)
    finally:
        owner.kill()
        owner.wait(10)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(server_pid) and psutil.Process(server_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "engine server outlived its owner"
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_shutdown_reaps_server(engine):
    pid = engine.process.pid
    children = psutil.Process(pid).children(recursive=True)
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert not psutil.pid_exists(pid)
    assert not any(c.is_running() for c in children)
