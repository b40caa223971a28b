"""slime.utils.http_utils `post` / `get` with slime's signature: caller headers reach the server (the agent adapters'
`X-SMG-Routing-Key`), `max_retries` counts attempts as slime's does, and the job's engine key wins over a caller's
Authorization for the job's own URLs, and `set_generate_rewrite` changes only the bodies posted to the policy's
`/generate`. Against real aiohttp servers on a thread."""

from __future__ import annotations

import contextlib

import pytest
from aiohttp import web

from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.utils import http_utils
from slime.utils.http_utils import HTTPRequestError, get, post, run_sync


@pytest.fixture
def server():
    hits = {"flaky": 0, "body": 0}

    async def echo(request):
        return web.json_response({"headers": dict(request.headers)})

    async def body(request):
        hits["body"] += 1
        return web.json_response({"body": await request.json()})

    async def flaky(request):
        hits["flaky"] += 1
        return web.Response(status=500, text="try again")

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/echo", echo)
    app.router.add_post("/flaky", flaky)
    app.router.add_post("/generate", body)
    app.router.add_post("/other", body)
    handle = run_app_in_thread(app, host="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{handle.port}", hits
    finally:
        handle.stop()
        http_utils.set_engine_api_key(None)
        http_utils.set_generate_rewrite(None)


def test_caller_headers_reach_the_server(server):
    url, _ = server
    out = run_sync(post(url + "/echo", {"a": 1}, headers={"X-SMG-Routing-Key": "sid-1"}))
    assert out["headers"]["X-SMG-Routing-Key"] == "sid-1"
    out = run_sync(post(url + "/echo", {"a": 1}, 0, {"X-SMG-Routing-Key": "sid-2"}))  # slime's positional order
    assert out["headers"]["X-SMG-Routing-Key"] == "sid-2"
    assert run_sync(get(url + "/echo", headers={"X-Test": "g"}))["headers"]["X-Test"] == "g"
    assert "X-SMG-Routing-Key" not in run_sync(post(url + "/echo", {}))["headers"]


@pytest.mark.parametrize("max_retries", [1, 3])
def test_max_retries_counts_attempts(server, max_retries):
    url, hits = server
    with pytest.raises(HTTPRequestError, match="500"):
        run_sync(post(url + "/flaky", {}, max_retries=max_retries, backoff=0.01))
    assert hits["flaky"] == max_retries


def test_the_job_key_wins_over_a_callers_authorization_on_its_own_urls(server):
    url, _ = server
    http_utils.set_engine_api_key("job-key")
    http_utils.trust_engine_url(url)
    out = run_sync(post(url + "/echo", {}, headers={"Authorization": "Bearer other", "X-SMG-Routing-Key": "s"}))
    assert out["headers"]["Authorization"] == "Bearer job-key" and out["headers"]["X-SMG-Routing-Key"] == "s"


def test_the_rewrite_changes_only_bodies_posted_to_the_policys_generate(server):
    url, _ = server
    http_utils.set_generate_rewrite(lambda body: {**body, "lora_path": "slime_lora"})
    sent = {"input_ids": [1, 2]}
    assert run_sync(post(url + "/generate", sent))["body"] == sent  # not yet one of the job's engines
    http_utils.trust_engine_url(url)
    assert run_sync(post(url + "/generate", sent))["body"] == {"input_ids": [1, 2], "lora_path": "slime_lora"}
    assert sent == {"input_ids": [1, 2]}  # the caller's body as it was
    assert run_sync(post(url + "/other", sent))["body"] == sent
    assert run_sync(post(url + "/generate", [1, 2]))["body"] == [1, 2]  # not a JSON object
    with server_of_another_model() as teacher:  # an OPD teacher: the key goes there, the rewrite does not
        http_utils.trust_engine_url(teacher, serves_policy=False)
        assert run_sync(post(teacher + "/generate", sent))["body"] == sent


def test_a_refused_rewrite_sends_nothing(server):
    url, hits = server
    http_utils.trust_engine_url(url)

    def refuse(body):
        raise ValueError("cannot take these ids")

    http_utils.set_generate_rewrite(refuse)
    with pytest.raises(ValueError, match="cannot take these ids"):
        run_sync(post(url + "/generate", {"input_ids": [1]}))
    assert hits["body"] == 0


@contextlib.contextmanager
def server_of_another_model():
    async def body(request):
        return web.json_response({"body": await request.json()})

    app = web.Application()
    app.router.add_post("/generate", body)
    handle = run_app_in_thread(app, host="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{handle.port}"
    finally:
        handle.stop()
