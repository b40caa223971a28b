"""Run coroutines from synchronous code on a background event loop (slime's `slime.utils.async_utils`).

There is one loop per process, in a daemon thread started on first use. The built-in rollout drives it through
`run_sync` (re-exported by `slime.utils.http_utils`); plugins written for slime call `run(coro)` or
`get_async_loop().run(coro)` from a synchronous rollout function (or a Ray actor method). All of them are the
same loop, so clients bound to it (aiohttp sessions, semaphores) stay valid whichever name a caller uses, and
no call creates a fresh loop (and fresh connection pools). A call blocks until the coroutine finishes and
returns its result or raises its exception; called from a coroutine already running on that loop it raises
(it would wait on itself) instead of hanging.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

__all__ = ["AsyncLoopThread", "get_async_loop", "run", "run_sync"]


class _BackgroundLoop:
    """An event loop running forever in a daemon thread; `run` blocks the caller until the coroutine is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def ensure(self) -> asyncio.AbstractEventLoop:
        """The loop, its thread started on first use (and again if the loop was closed)."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="slime-rollout-loop", daemon=True)
                thread.start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine) -> Any:
        loop = self.ensure()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("run_sync() called from inside the background loop; await the coroutine instead")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise


_background = _BackgroundLoop()


def run_sync(coro: Coroutine) -> Any:
    """Run `coro` on the shared background loop and return its result (usable from sync and async callers)."""
    return _background.run(coro)


class AsyncLoopThread:
    """slime's handle on the background loop: `.loop` (the event loop itself) and `.run(coro)`."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return _background.ensure()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Schedule `coro` on the loop and wait for its result."""
        return run_sync(coro)


_handle = AsyncLoopThread()


def get_async_loop() -> AsyncLoopThread:
    """The process's background loop (its thread starts on first use)."""
    return _handle


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on the background event loop and return its result (slime's name for `run_sync`)."""
    return run_sync(coro)
