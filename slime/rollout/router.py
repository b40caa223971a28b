"""sglang-router: a client for its worker-registration API and a wrapper that owns a router process.

Measured against sglang-router 0.3.2 (the pinned wheel):
- `POST /workers {"url": u}` answers 202 with a `worker_id`; the addition is queued and the router then
  probes the worker (`/health`, `/get_server_info`, `/get_model_info`), so we poll `GET /workers` until
  the url is listed. Adding a url twice answers the same `worker_id`.
- `DELETE /workers/{worker_id}` answers 202; removal is queued too, so we poll until the url is gone.
- `GET /workers` -> `{"workers": [{"id", "url", "is_healthy", ...}], "total": n, ...}`.
- The process renames itself `sglang::router`; SIGTERM stops it in about a second.

With a key (`--engine-api-key`), measured against 0.3.2 as well:
- `launch_router --api-key K` makes the router itself require `Authorization: Bearer K` on its endpoints
  (`/generate`, `/workers`, `/flush_cache`, `/get_loads`, ...; 401 without it or with another key). Still open
  without it: `/health`, `/liveness`, `/readiness`, `/get_server_info`, `/v1/models` (worker counts and model
  ids only), and `/get_model_info`, which the router passes to a worker without any key (a keyed worker then
  answers 401).
- A worker registered with `{"url": u, "api_key": K}` gets the key on what the router sends it: the probes of
  `/server_info` and `/model_info`, `/generate`, `/get_load`, the `/flush_cache` broadcast (`/health` goes
  bare, which SGLang and the hf engine leave open). Registered without one, the router probes it bare, logs a
  warning, and lists it with model id "unknown".
So `RouterClient` sends the key on every call and registers workers with it.

Simplifications: one router per manager, regular (non prefill/decode) workers only. Routers older than
the `/workers` API (`/add_worker?url=`, `/remove_worker?url=`, `/list_workers`) are still spoken to
when the new endpoint answers 404, so an external router of an older release keeps working.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from slime.utils.http_utils import bearer_headers
from slime.utils.net import free_port
from slime.utils.processes import shown_command, spawn, stop_process_group

logger = logging.getLogger(__name__)

_STARTUP_ATTEMPTS = 3


def router_cli_args(extra_args: dict[str, Any] | None) -> list[str]:
    """`{"foo_bar": v}` -> `["--foo-bar", "v"]`; True -> bare flag, False/None -> omitted, list -> repeated values."""
    out: list[str] = []
    for key, value in (extra_args or {}).items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def _norm(url: str) -> str:
    return url.rstrip("/")


def _json(r: httpx.Response) -> dict[str, Any]:
    """`r`'s JSON object, or {} when its body is empty or not JSON."""
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def url_of(host: str, port: int) -> str:
    """`http://host:port` to connect to (all interfaces -> loopback; an IPv6 address in brackets)."""
    host = "127.0.0.1" if host in ("", "0.0.0.0") else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class RouterClient:
    """Worker registration on a running sglang-router at `url` (ours or an external one). With `api_key` every
    call carries it and workers are registered with it (the router then sends it to them)."""

    def __init__(self, url: str, timeout: float = 30.0, api_key: str | None = None):
        self.url = _norm(url)
        self.api_key = api_key
        self._http = httpx.Client(timeout=timeout, headers=bearer_headers(api_key))

    # ---- queries --------------------------------------------------------------------------------
    def workers(self) -> list[dict[str, Any]]:
        """The router's worker records (`id`, `url`, `is_healthy`, ...)."""
        r = self._http.get(f"{self.url}/workers")
        if r.status_code == 404:  # router older than the /workers API
            r = self._http.get(f"{self.url}/list_workers")
            r.raise_for_status()
            return [{"id": None, "url": u} for u in r.json().get("urls", [])]
        r.raise_for_status()
        return r.json().get("workers", [])

    def list_workers(self) -> list[str]:
        return [_norm(w["url"]) for w in self.workers()]

    def is_alive(self) -> bool:
        try:
            return self._http.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    # ---- registration ---------------------------------------------------------------------------
    def add_worker(self, url: str, timeout: float = 60.0) -> str | None:
        """Register `url` and wait until the router lists it. Returns the router's worker id."""
        url = _norm(url)
        body = {"url": url, **({"api_key": self.api_key} if self.api_key else {})}
        r = self._http.post(f"{self.url}/workers", json=body)
        worker_id = None
        if r.status_code == 404:
            r = self._http.post(f"{self.url}/add_worker", params={"url": url})
        elif r.status_code < 300:
            worker_id = _json(r).get("worker_id")  # an accepted add may come without a body: listing decides
        if r.status_code >= 300:
            raise RuntimeError(f"router {self.url}: adding worker {url} answered {r.status_code}: {r.text[:500]}")
        self._wait(lambda: url in self.list_workers(), timeout, f"worker {url} to be listed", worker_id)
        return worker_id

    def remove_worker(self, url: str, timeout: float = 30.0) -> bool:
        """Deregister `url` and wait until it is gone. Returns False if it was not registered."""
        url = _norm(url)
        record = next((w for w in self.workers() if _norm(w["url"]) == url), None)
        if record is None:
            return False
        if record.get("id"):
            r = self._http.delete(f"{self.url}/workers/{record['id']}")
        else:
            r = self._http.post(f"{self.url}/remove_worker", params={"url": url})
        if r.status_code >= 300:
            raise RuntimeError(f"router {self.url}: removing worker {url} answered {r.status_code}: {r.text[:500]}")
        self._wait(lambda: url not in self.list_workers(), timeout, f"worker {url} to be removed", record.get("id"))
        return True

    def _wait(self, done, timeout: float, what: str, worker_id: str | None) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            self._check_running()
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"router {self.url}: timed out after {timeout:.0f}s waiting for {what}; "
                    f"{self._job_status(worker_id)}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _job_status(self, worker_id: str | None) -> str:
        """The router's own account of a queued job (e.g. why the worker's health check fails)."""
        if not worker_id:
            return "no job status available"
        try:
            status = self._http.get(f"{self.url}/workers/{worker_id}").json().get("job_status")
            return f"router job status: {status}"
        except (httpx.HTTPError, ValueError) as e:
            return f"job status unavailable ({e})"

    def _check_running(self) -> None:
        """Hook for the owning wrapper: raise if the router process died."""

    def close(self) -> None:
        self._http.close()


class RouterProcess(RouterClient):
    """Owns one router process: `python -m slime.rollout.launch_sglang_router`, which takes the flags of
    `python -m sglang_router.launch_router` and starts the same Rust router without importing SGLang.

    The process runs in its own session (so `stop()` can signal its whole group) with PR_SET_PDEATHSIG
    (so it dies with its parent even when the parent is SIGKILLed); its output goes to
    `{log_dir}/sglang_router_{port}.log`, whose tail is quoted if it exits early. `stop()` is idempotent
    and also registered with atexit.
    """

    def __init__(
        self,
        host: str,
        port: int | None,
        policy: str = "round_robin",
        extra_args: dict[str, Any] | None = None,
        log_dir: str | None = None,
        startup_timeout: float = 60.0,
        api_key: str | None = None,
    ):
        self.host = host
        self.api_key = api_key
        self.policy = policy
        self.extra_args = dict(extra_args or {})
        self.log_dir = log_dir or os.environ.get("SLIME_LOG_DIR") or tempfile.gettempdir()
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._auto_port = not port
        # The router also serves Prometheus metrics, on 29000 unless told otherwise: a second router on the
        # same host would die on that port, so ours gets a free one unless the caller chose it.
        self._auto_prometheus_port = "prometheus_port" not in self.extra_args
        self._set_port(port or free_port(host))

    def _set_port(self, port: int) -> None:
        self.port = port
        if self._auto_prometheus_port:
            self._prometheus_port = free_port(self.host)
        self.log_path = os.path.join(self.log_dir, f"sglang_router_{port}.log")
        super().__init__(url_of(self.host, port), api_key=self.api_key)

    def command(self) -> list[str]:
        extra = dict(self.extra_args)
        extra.setdefault("log_level", "warn")
        if self._auto_prometheus_port:
            extra["prometheus_host"] = extra.get("prometheus_host", self.host)
            extra["prometheus_port"] = self._prometheus_port
        return [
            sys.executable, "-m", "slime.rollout.launch_sglang_router",
            "--host", self.host, "--port", str(self.port), "--policy", self.policy,
            *router_cli_args(extra),
            *(["--api-key", self.api_key] if self.api_key else []),
        ]  # fmt: skip

    def start(self) -> RouterProcess:
        """Launch the router and wait until it answers GET /health. A port we picked ourselves can be taken
        by someone else before the router binds it; then we retry on fresh ones."""
        if self.proc is not None:
            return self
        os.makedirs(self.log_dir, exist_ok=True)
        for attempt in range(_STARTUP_ATTEMPTS):
            try:
                self._launch_and_wait()
                return self
            except RuntimeError as e:
                retry = self._auto_port or self._auto_prometheus_port
                if not (retry and "address already in use" in str(e).lower()) or attempt + 1 == _STARTUP_ATTEMPTS:
                    raise
                self._set_port(free_port(self.host) if self._auto_port else self.port)
        return self

    def _launch_and_wait(self) -> None:
        cmd = self.command()
        with open(self.log_path, "wb") as log:
            self.proc = spawn(cmd, log)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while not self.is_alive():
                self._check_running()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"sglang-router did not answer {self.url}/health within {self.startup_timeout:.0f}s "
                        f"(command: {shown_command(cmd)}); log {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.1)
            self._check_running()  # something else may answer on a port given to us; make sure ours is alive
        except BaseException:
            self.stop()
            raise
        logger.info("sglang-router up at %s (pid %d, log %s)", self.url, self.proc.pid, self.log_path)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _check_running(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"sglang-router exited with code {self.proc.returncode} "
                f"(command: {shown_command(self.command())}); log {self.log_path}:\n{self.log_tail()}"
            )

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the router's process group, wait, then SIGKILL. Safe to call more than once."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        stop_process_group(proc, timeout)
