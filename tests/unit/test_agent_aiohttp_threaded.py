"""slime.agent.aiohttp_threaded: an app served from a thread answers, a taken port fails clearly, stop() joins."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from aiohttp import web

from slime.agent.aiohttp_threaded import FilteredAccessLogger, run_app_in_thread


def _app() -> web.Application:
    async def ok(request):
        return web.json_response({"ok": True})

    async def bad(request):
        return web.Response(status=500, text="boom")

    app = web.Application()
    app.router.add_get("/ok", ok)
    app.router.add_get("/bad", bad)
    return app


def _access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]


def test_serves_logs_only_failures_and_stops(caplog):
    handle = run_app_in_thread(_app(), host="127.0.0.1", runner_kwargs={"access_log_class": FilteredAccessLogger})
    try:
        url = f"http://127.0.0.1:{handle.port}"
        with caplog.at_level(logging.INFO, logger="aiohttp.access"):
            assert httpx.get(url + "/ok", trust_env=False).json() == {"ok": True}
            assert httpx.get(url + "/bad", trust_env=False).status_code == 500
            # aiohttp logs a request after its response is sent, in the server's thread: wait for /bad's line
            deadline = time.monotonic() + 10
            while not _access_lines(caplog) and time.monotonic() < deadline:
                time.sleep(0.01)
        logged = _access_lines(caplog)
        assert len(logged) == 1 and "/bad" in logged[0]
        with pytest.raises(RuntimeError, match=f"could not serve on 127.0.0.1:{handle.port}"):
            run_app_in_thread(_app(), host="127.0.0.1", port=handle.port)
    finally:
        handle.stop()
    assert not handle.thread.is_alive() and handle.loop.is_closed()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{handle.port}/ok", trust_env=False)
    handle.stop()
