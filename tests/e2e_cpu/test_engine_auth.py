"""`--engine-api-key` against real processes: an hf engine server walked route by route (its route table, so a new
endpoint cannot be left open by mistake), the real sglang-router 0.3.2 in front of it, slime's clients of both, and
train.py with `--engine-api-key auto`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import httpx
import pytest

from slime.backends.hf_engine.auth import is_open
from slime.backends.hf_engine.engine import HFEngine
from slime.backends.hf_engine.server import build_app
from slime.backends.server_engine import EngineHTTPError
from slime.rollout.router import RouterClient, RouterProcess
from slime.utils import http_utils
from slime.utils.processes import shown_command
from slime.utils.tracking import read_scalars
from tests.args import make_args
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes

KEY = "test-key-0123456789abcdefABCDEF"
PROMPT = [56, 62, 137, 92]
GENERATE = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
# Bodies that would change the engine if the request got through: the walk checks afterwards that none did.
HARMFUL = {
    "/update_weight_version": {"new_version": "hijacked"},
    "/update_weights_from_disk": {"model_path": "{model}", "weight_version": "hijacked"},
    "/release_memory_occupation": {},
    "/pause_generation": {"mode": "in_place"},
    "/weights_checker": {"action": "reset_tensors"},
    "/generate": GENERATE,
}


def route_table() -> list[tuple[str, str]]:
    """(path, method) of every route the engine's app serves: the table `build_app` builds, docs pages included.
    The state is only read when a request is handled, so an empty stand-in serves to list the routes."""
    app = build_app(types.SimpleNamespace(scheduler=None), api_key="k")
    return sorted((r.path, m) for r in app.routes for m in getattr(r, "methods", None) or ["GET"])


@pytest.fixture(scope="module")
def keyed_engine(tiny_model_dir):
    eng = HFEngine(make_args("--engine-api-key", KEY, hf_checkpoint=tiny_model_dir, sglang_server_concurrency=4), 0)
    try:
        eng.init()
        yield eng
    finally:
        eng.shutdown()


def _send(url: str, path: str, method: str, headers: dict, model: str) -> httpx.Response:
    body = HARMFUL.get(path, {})
    if "model_path" in body:
        body = {**body, "model_path": model}
    kwargs = {"json": body} if method in ("POST", "PUT", "PATCH", "DELETE") else {}
    return httpx.request(method, url + path, headers=headers, timeout=60, trust_env=False, **kwargs)


def _state(url: str) -> dict:
    info = httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    return {k: info[k] for k in ("weight_version", "paused", "released_tags", "num_finished_requests")}


@pytest.mark.timeout(240)
def test_every_route_refuses_a_missing_or_wrong_key_and_changes_nothing(keyed_engine, tiny_model_dir):
    url = keyed_engine.get_url()
    routes = route_table()
    served = json.loads(httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).text)["paths"]
    assert set(served) <= {p for p, _ in routes}, "the route table must list every path the server documents"
    guarded = [(p, m) for p, m in routes if not is_open(m, p)]
    assert {"/generate", "/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weights_from_disk",
            "/init_weights_update_group", "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache",
            "/abort_request", "/pause_generation", "/continue_generation", "/get_load", "/update_weight_version",
            "/weights_checker", "/model_info", "/server_info", "/openapi.json"} <= {p for p, _ in guarded}
    before = _state(url)
    model = tiny_model_dir
    wrong = ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"})
    for headers in wrong:
        for path, method in guarded:
            resp = _send(url, path, method, headers, model)
            assert resp.status_code == 401, (path, method, headers, resp.status_code, resp.text[:300])
            if method != "HEAD":
                assert "Authorization: Bearer <key>" in resp.json()["message"], resp.text
        assert _state(url) == before, headers  # nothing generated, paused, released or restamped
    # an unknown path is refused like a known one: a caller without the key learns nothing of the routes
    assert httpx.get(url + "/no_such_route", timeout=10).status_code == 401
    # open, as in SGLang: liveness probes carry no secret
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200


@pytest.mark.timeout(240)
def test_with_the_key_every_route_answers_and_the_control_client_works(keyed_engine, tiny_model_dir):
    url, auth = keyed_engine.get_url(), {"Authorization": f"Bearer {KEY}"}
    model = tiny_model_dir
    for path, method in route_table():
        resp = _send(url, path, method, auth, model)
        assert resp.status_code not in (401, 403), (path, method, resp.text[:300])
    assert httpx.post(url + "/update_weight_version", json={"new_version": "v7"}, headers=auth).status_code == 200
    # slime's control client (ServerEngine) sends the key by itself
    assert keyed_engine.get_weight_version() == "v7"
    keyed_engine.continue_generation()
    keyed_engine.resume_memory_occupation()
    keyed_engine.update_weights_from_disk(model, "v8")  # the walk's reset_tensors is undone by a complete load
    keyed_engine.check_weights("snapshot")
    keyed_engine.update_weights_from_disk(model, "v8")
    keyed_engine.check_weights("compare")
    assert keyed_engine.get_load()[0]["num_reqs"] == 0
    keyed_engine.wait_idle(5)
    keyed_engine.flush_cache()
    keyed_engine.abort_all()
    assert keyed_engine.health_generate(30)
    out = httpx.post(url + "/generate", json=GENERATE, headers=auth, timeout=60).json()
    assert len(out["output_ids"]) == 2 and out["meta_info"]["weight_version"] == "v8"
    # a control client holding another key is refused, and the error says how to fix it
    wrong = HFEngine(make_args("--engine-api-key", "another-key", hf_checkpoint=tiny_model_dir), 0)
    wrong.port, wrong.host = keyed_engine.port, keyed_engine.host
    with pytest.raises(EngineHTTPError, match=r"HTTP 401.*Authorization: Bearer <key>"):
        wrong.get_model_info()


@pytest.mark.timeout(180)
def test_the_router_requires_the_key_and_passes_it_to_the_engine(keyed_engine, tmp_path):
    url, auth = keyed_engine.get_url(), {"Authorization": f"Bearer {KEY}"}
    router = RouterProcess(host="127.0.0.1", port=None, log_dir=str(tmp_path), api_key=KEY)
    try:
        router.start()
        shown = shown_command(router.command())
        assert "--api-key ***" in shown and KEY not in shown and KEY in router.command()
        # without the key the router refuses to register a worker, and lists none
        bare = RouterClient(router.url)
        with pytest.raises(RuntimeError, match="answered 401"):
            bare.add_worker(url, timeout=5)
        assert httpx.get(router.url + "/workers", timeout=10).status_code == 401
        router.add_worker(url)  # slime's client: the key on its calls, and in the registration for the probes
        [worker] = router.workers()
        assert worker["is_healthy"] and worker["model_id"] != "unknown", worker  # the router's probes got in
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            resp = httpx.post(router.url + "/generate", json=GENERATE, headers=headers, timeout=30)
            assert resp.status_code == 401, resp.text
        resp = httpx.post(router.url + "/generate", json=GENERATE, headers=auth, timeout=60)
        assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 2, resp.text
        # slime's HTTP helpers send the key to the origins the job trusts, and to no other
        http_utils.set_engine_api_key(KEY)
        try:
            with pytest.raises(http_utils.HTTPRequestError, match="HTTP 401"):
                http_utils.run_sync(http_utils.post(router.url + "/generate", GENERATE, retries=0))
            http_utils.trust_engine_url(router.url)
            out = http_utils.run_sync(http_utils.post(router.url + "/generate", GENERATE, retries=0))
            assert len(out["output_ids"]) == 2
        finally:
            http_utils.set_engine_api_key(None)
            http_utils._engine_origins.discard(http_utils._origin(router.url))
        assert router.remove_worker(url)
        bare.close()
    finally:
        router.stop()


AUTH_CHECK_RM = '''
import json, os
import httpx

async def checked_reward(args, sample):
    out = os.environ["AUTH_CHECK_OUT"]
    if not os.path.exists(out):
        router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
        workers = httpx.get(router + "/workers", headers={"Authorization": f"Bearer {args.engine_api_key}"}).json()
        engine = workers["workers"][0]["url"]
        result = {
            "key": args.engine_api_key,
            "router_bare": httpx.get(router + "/workers").status_code,
            "engine_bare": httpx.get(engine + "/get_load").status_code,
            "engine_keyed": httpx.get(engine + "/get_load",
                                      headers={"Authorization": f"Bearer {args.engine_api_key}"}).status_code,
        }
        with open(out, "w") as f:
            json.dump(result, f)
    return 1.0 if sample.response.strip().split(" ")[:1] == [str(sample.label)] else 0.0
'''


@pytest.mark.timeout(300)
def test_train_py_with_an_auto_key_trains_behind_keyed_engines(tiny_model_dir, toy_data_path, tmp_path):
    rm_file = tmp_path / "auth_rm.py"
    rm_file.write_text(AUTH_CHECK_RM)
    tb_dir, logs, result = tmp_path / "tb", tmp_path / "logs", tmp_path / "auth.json"
    env = dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO_ROOT, AUTH_CHECK_OUT=str(result), SLIME_ENGINE_LOG_DIR=str(logs),
               SLIME_LOG_DIR=str(logs))
    before = run_processes()
    out = subprocess.run([
        sys.executable, os.path.join(REPO_ROOT, "train.py"),
        "--hf-checkpoint", tiny_model_dir, "--prompt-data", toy_data_path, "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--lr", "1e-3", "--micro-batch-size", "4", "--global-batch-size", "4",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-rollout", "2",
        "--custom-rm-path", f"{rm_file}:checked_reward", "--engine-api-key", "auto",
        "--use-tensorboard", "--tensorboard-dir", str(tb_dir),
    ], capture_output=True, text=True, env=env, timeout=280, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-4000:]
    assert sorted(read_scalars(str(tb_dir), "train/loss")) == [0, 1]  # both rollouts trained, weights pushed
    # the manager's per-engine request counts (GET /server_info) carried the key: 2 prompts x 2 samples each rollout
    assert read_scalars(str(tb_dir), "rollout/engine_requests/0") == {0: 4.0, 1: 4.0}
    checked = json.loads(result.read_text())
    key = checked["key"]
    assert key != "auto" and len(key) >= 40
    assert checked["router_bare"] == 401 and checked["engine_bare"] == 401 and checked["engine_keyed"] == 200
    assert key[:4] in out.stderr  # the log names the key by its first characters only
    assert key not in out.stdout + out.stderr
    for name in os.listdir(logs):
        with open(logs / name, errors="replace") as f:
            assert key not in f.read(), name
    assert wait_for_no_new_processes(before) == {}
