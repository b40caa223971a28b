"""HTTP helpers for the rollout side: one shared `httpx.AsyncClient` per event loop, `post`/`get` with
retries, and a persistent background event loop so synchronous callers (Ray actor methods) can run
coroutines without creating a fresh loop (and fresh connection pools) on every call.

Simplifications: retries cover transport errors (connection refused/reset, timeouts) and 5xx answers;
a 4xx answer is the caller's fault and fails at once. Backoff is exponential, capped at 5 s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Coroutine
from typing import Any

import httpx

logger = logging.getLogger(__name__)

# Generous: the default rollout keeps sglang_server_concurrency x engines requests open at once.
_LIMITS = httpx.Limits(max_connections=16384, max_keepalive_connections=1024)
# Generation can take minutes for long responses; only the connect phase gets a short limit.
_TIMEOUT = httpx.Timeout(None, connect=30.0)

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


class HTTPRequestError(RuntimeError):
    """A request that failed for good; the message names the URL, the status and the server's reply."""

    def __init__(self, url: str, message: str, status_code: int | None = None, response_text: str | None = None):
        self.url = url
        self.status_code = status_code
        self.response_text = response_text
        super().__init__(message)


def get_client() -> httpx.AsyncClient:
    """The `httpx.AsyncClient` of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        client = httpx.AsyncClient(limits=_LIMITS, timeout=_TIMEOUT)
        _clients[loop] = client
    return client


async def close_client() -> None:
    """Close the running loop's client (call before the loop itself is closed to avoid warnings)."""
    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


async def post(
    url: str, payload: Any = None, retries: int = 3, backoff: float = 0.5, timeout: float | None = None
) -> Any:
    """POST `payload` as JSON and return the decoded JSON answer (or the text when it is not JSON)."""
    return await _request("POST", url, payload, retries, backoff, timeout)


async def get(url: str, retries: int = 3, backoff: float = 0.5, timeout: float | None = None) -> Any:
    """GET `url` and return the decoded JSON answer (or the text when it is not JSON)."""
    return await _request("GET", url, None, retries, backoff, timeout)


async def _request(method: str, url: str, payload: Any, retries: int, backoff: float, timeout: float | None) -> Any:
    client = get_client()
    kwargs: dict[str, Any] = {}
    if payload is not None:
        kwargs["json"] = payload
    if timeout is not None:
        kwargs["timeout"] = httpx.Timeout(timeout, connect=min(timeout, 30.0))
    attempts = max(1, retries + 1)
    last_error = ""
    for attempt in range(attempts):
        try:
            response = await client.request(method, url, **kwargs)
        except httpx.TransportError as e:
            last_error = f"{type(e).__name__}: {e}"
        else:
            if response.status_code < 400:
                try:
                    return response.json()
                except ValueError:
                    return response.text
            text = response.text[:2000]
            if response.status_code < 500:
                raise HTTPRequestError(
                    url, f"{method} {url} -> HTTP {response.status_code}: {text}", response.status_code, text
                )
            last_error = f"HTTP {response.status_code}: {text}"
        if attempt + 1 < attempts:
            delay = min(backoff * (2**attempt), 5.0)
            logger.warning(
                "%s %s failed (%s); retry %d/%d in %.1fs", method, url, last_error, attempt + 1, retries, delay
            )
            await asyncio.sleep(delay)
    raise HTTPRequestError(url, f"{method} {url} failed after {attempts} attempt(s): {last_error}")


class _BackgroundLoop:
    """An event loop running forever in a daemon thread; `run` blocks the caller until the coroutine is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="slime-rollout-loop", daemon=True)
                thread.start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine) -> Any:
        loop = self._ensure()
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
