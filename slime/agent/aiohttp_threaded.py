"""Serve an `aiohttp.web.Application` from a daemon thread with its own event loop (slime's
`slime.agent.aiohttp_threaded`): the adapters listen while the rollout's own loop runs the generate functions.

`run_app_in_thread` returns once the site listens (or raises what stopped it); `AppHandle.stop()` closes the
site and the loop and joins the thread. `FilteredAccessLogger` logs only what is worth reading: failed requests
and slow ones.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger


class FilteredAccessLogger(AccessLogger):
    """Access log without HEAD probes and without fast successful requests (agents send thousands)."""

    SLOW_THRESHOLD_SEC = 120.0

    def log(self, request, response, time):
        if request.method == "HEAD" or (response.status == 200 and time <= self.SLOW_THRESHOLD_SEC):
            return
        super().log(request, response, time)


@dataclass
class AppHandle:
    host: str
    port: int
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner

    def stop(self, timeout: float = 10.0) -> None:
        """Close the server, stop its loop and join the thread (idempotent)."""
        if not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=timeout)


def run_app_in_thread(
    app: web.Application,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    thread_name: str = "aiohttp-app",
    start_timeout_sec: float = 15.0,
    runner_kwargs: dict[str, Any] | None = None,
) -> AppHandle:
    """Start `app` on `host:port` (0: a free port, read back into `AppHandle.port`); `runner_kwargs` go to
    `web.AppRunner` (e.g. `handler_cancellation=True`, `access_log_class=FilteredAccessLogger`)."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner = web.AppRunner(app, **(runner_kwargs or {}))
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            try:
                loop.run_until_complete(site.start())
            except BaseException:
                loop.run_until_complete(runner.cleanup())
                raise
            state.update(loop=loop, runner=runner, port=runner.addresses[0][1])
        except BaseException as e:
            state["error"] = e
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=serve, name=thread_name, daemon=True)
    thread.start()
    if not ready.wait(timeout=start_timeout_sec):
        raise TimeoutError(f"{thread_name}: the aiohttp app did not start listening on {host}:{port} within "
                           f"{start_timeout_sec:.0f}s")
    if "error" in state:
        thread.join()
        raise RuntimeError(f"{thread_name}: could not serve on {host}:{port}: {state['error']}") from state["error"]
    return AppHandle(host=host, port=int(state["port"]), thread=thread, loop=state["loop"], runner=state["runner"])
