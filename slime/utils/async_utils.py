"""Run coroutines from synchronous code on the background event loop (slime's `slime.utils.async_utils`).

Plugins written for slime call `run(coro)` from a synchronous rollout function (or a Ray actor method) to
drive async generate / reward code. There is one loop per process, in a daemon thread started on first use:
the same loop the built-in rollout drives through `slime.utils.http_utils.run_sync`, so clients bound to it
(aiohttp sessions, semaphores) stay valid whichever of the two names a caller uses. `run` blocks until the
coroutine finishes and returns its result or raises its exception; called from a coroutine already running
on that loop it raises (it would wait on itself) instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from slime.utils import http_utils

__all__ = ["AsyncLoopThread", "get_async_loop", "run"]


class AsyncLoopThread:
    """slime's handle on the background loop: `.loop` (the event loop itself) and `.run(coro)`."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return http_utils._background._ensure()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Schedule `coro` on the loop and wait for its result."""
        return http_utils.run_sync(coro)


_handle = AsyncLoopThread()


def get_async_loop() -> AsyncLoopThread:
    """The process's background loop (its thread starts on first use)."""
    return _handle


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on the background event loop and return its result."""
    return http_utils.run_sync(coro)
