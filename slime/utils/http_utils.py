"""HTTP helpers for the rollout side: one shared `aiohttp.ClientSession` per event loop and `post`/`get` with
retries. `run_sync` (run a coroutine on the process's background event loop, so synchronous callers such as Ray
actor methods reuse one loop and its connection pools) lives in `slime.utils.async_utils` and is re-exported
here for callers that import it from this module.

Engine authentication (`--engine-api-key`): `set_engine_api_key(key)` and `trust_engine_url(url)` (the
RolloutManager calls them for the job's router, engines and OPD teacher) make `post` / `get` send
`Authorization: Bearer <key>` to those origins (scheme, host and port) only, so plugins that call the engines
through these helpers need no change, and a reward server or any other URL never sees the key.

Requests a plugin builds itself: `set_generate_rewrite(fn)` (the RolloutManager's) makes `post` send `fn(payload)`
for a JSON object posted to the policy's router or engines at `/generate`, so slime's plugins work unchanged where
our engines need more than slime's request (the LoRA adapter's name; images with one image token each for SGLang).

Simplifications: retries cover transport errors (connection refused/reset, timeouts) and 5xx answers;
a 4xx answer is the caller's fault and fails at once. Backoff is exponential, capped at 5 s.

Why aiohttp and not httpx here: with a rollout's burst of concurrent requests, httpx's async pool spread
128 requests over 1-4 s (measured against one hf engine), so the engine prefilled them in dozens of small
pieces; aiohttp delivered the same burst in 0.25 s. Synchronous control calls elsewhere use httpx; one-off
synchronous GETs (health probes, counters) go through `probe_get`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from typing import Any, Callable
from urllib.parse import urlsplit

import aiohttp
import httpx

from slime.utils.async_utils import run_sync

__all__ = ["HTTPRequestError", "bearer_headers", "close_client", "engine_auth_headers", "get", "get_client", "post",
           "probe_get", "run_sync", "set_engine_api_key", "set_generate_rewrite", "trust_engine_url"]

logger = logging.getLogger(__name__)

# Generous: the default rollout keeps sglang_server_concurrency x engines requests open at once.
_MAX_CONNECTIONS = 16384
# Generation can take minutes for long responses; only the connect phase gets a short limit.
_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=30.0)

_engine_api_key: str | None = None
_engine_origins: set[tuple[str, str, int | None]] = set()
_policy_origins: set[tuple[str, str, int | None]] = set()  # the policy's router and engines (not an OPD teacher)
_generate_rewrite: Callable[[dict], dict] | None = None

_probe_client: httpx.Client | None = None

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = weakref.WeakKeyDictionary()


class HTTPRequestError(RuntimeError):
    """A request that failed for good; the message names the URL, the status and the server's reply."""

    def __init__(self, url: str, message: str, status_code: int | None = None, response_text: str | None = None):
        self.url = url
        self.status_code = status_code
        self.response_text = response_text
        super().__init__(message)


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """`{"Authorization": "Bearer <key>"}`, or `{}` without a key (the engines then require none)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _split(url: str):
    return urlsplit(url if "://" in url else f"http://{url}")


def _origin(url: str) -> tuple[str, str, int | None]:
    return _origin_of(_split(url))


def _origin_of(parts) -> tuple[str, str, int | None]:
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def set_engine_api_key(api_key: str | None) -> None:
    """The key `post` / `get` send to the origins of `trust_engine_url` (None: send none)."""
    global _engine_api_key
    _engine_api_key = api_key or None


def trust_engine_url(url: str, *, serves_policy: bool = True) -> None:
    """Send the engine key to `url`'s origin (scheme, host, port) from now on: an engine or router of this job;
    `serves_policy` False for one serving another model (the OPD teacher), whose requests `set_generate_rewrite`
    leaves alone."""
    origin = _origin(url)
    _engine_origins.add(origin)
    if serves_policy:
        _policy_origins.add(origin)


def set_generate_rewrite(rewrite: Callable[[dict], dict] | None) -> None:
    """`post` sends `rewrite(payload)` for a JSON object posted to `/generate` of the policy's router or engines
    (`trust_engine_url`; None: as given).
    `rewrite` returns a new object (the caller's is left as it was) or raises ValueError for a request the engines
    cannot serve."""
    global _generate_rewrite
    _generate_rewrite = rewrite


def _rewritten(url: str, payload: Any) -> Any:
    if _generate_rewrite is None or not isinstance(payload, dict):
        return payload
    parts = _split(url)
    if _origin_of(parts) not in _policy_origins or parts.path.rstrip("/") != "/generate":
        return payload
    return _generate_rewrite(payload)


def engine_auth_headers(url: str) -> dict[str, str]:
    """The Authorization header `post` / `get` add for `url`: the engine key when its origin is trusted."""
    if _engine_api_key is None or _origin(url) not in _engine_origins:
        return {}
    return bearer_headers(_engine_api_key)


def probe_get(url: str, *, timeout: float, headers: dict[str, str] | None = None) -> httpx.Response:
    """A synchronous GET on a connection of its own, as `httpx.get(url, trust_env=False)` makes it (no proxy from
    the environment, no connection kept for the next call), through one client per process: `httpx.get` builds
    a client, and with it an SSL context (~30 ms of CPU), on every call, which start-up probes every 0.2 s and
    the per-rollout counters paid each time. Raises what `httpx.get` raises."""
    global _probe_client
    if _probe_client is None:
        _probe_client = httpx.Client(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
    return _probe_client.get(url, timeout=timeout, headers=headers)


def get_client() -> aiohttp.ClientSession:
    """The `aiohttp.ClientSession` of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.closed:
        client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=_MAX_CONNECTIONS), timeout=_TIMEOUT, trust_env=False
        )
        _clients[loop] = client
    return client


async def close_client() -> None:
    """Close the running loop's client (call before the loop itself is closed to avoid warnings)."""
    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.close()


async def post(
    url: str, payload: Any = None, retries: int = 3, headers: dict[str, str] | None = None, *,
    backoff: float = 0.5, timeout: float | None = None, max_retries: int | None = None,
) -> Any:
    """POST `payload` as JSON and return the decoded JSON answer (or the text when it is not JSON), with `headers`
    added. The engine key goes with it when `url` is one of this job's engines or its router (`trust_engine_url`).
    slime's signature is `post(url, payload, max_retries=60, headers=None)`: positional calls mean the same here,
    and `max_retries=N` (attempts in all) is `retries=N - 1`; the default retries fewer times than slime's."""
    if max_retries is not None:
        retries = max_retries - 1
    return await _request("POST", url, _rewritten(url, payload), retries, backoff, timeout, headers)


async def get(url: str, retries: int = 3, headers: dict[str, str] | None = None, *, backoff: float = 0.5,
              timeout: float | None = None) -> Any:
    """GET `url` and return the decoded JSON answer (or the text when it is not JSON); headers and key as `post`."""
    return await _request("GET", url, None, retries, backoff, timeout, headers)


async def _request(method: str, url: str, payload: Any, retries: int, backoff: float, timeout: float | None,
                   extra_headers: dict[str, str] | None = None) -> Any:
    client = get_client()
    kwargs: dict[str, Any] = {}
    headers = {**(extra_headers or {}), **engine_auth_headers(url)}  # the job's key wins over a caller's header
    if headers:
        kwargs["headers"] = headers
    if payload is not None:
        kwargs["json"] = payload
    if timeout is not None:
        kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout, connect=min(timeout, 30.0))
    attempts = max(1, retries + 1)
    last_error = ""
    for attempt in range(attempts):
        try:
            async with client.request(method, url, **kwargs) as response:
                status, text = response.status, await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            last_error = f"{type(e).__name__}: {e}"
        else:
            if status < 400:
                try:
                    return json.loads(text)
                except ValueError:
                    return text
            text = text[:2000]
            if status < 500:
                raise HTTPRequestError(url, f"{method} {url} -> HTTP {status}: {text}", status, text)
            last_error = f"HTTP {status}: {text}"
        if attempt + 1 < attempts:
            delay = min(backoff * (2**attempt), 5.0)
            logger.warning(
                "%s %s failed (%s); retry %d/%d in %.1fs", method, url, last_error, attempt + 1, retries, delay
            )
            await asyncio.sleep(delay)
    raise HTTPRequestError(url, f"{method} {url} failed after {attempts} attempt(s): {last_error}")
