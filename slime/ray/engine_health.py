"""Engine health monitoring for `--use-fault-tolerance` (used by the RolloutManager).

A daemon thread waits `--rollout-health-check-first-wait` seconds, then every
`--rollout-health-check-interval` seconds asks each live engine for `GET /health_generate` (one generated
token; SGLang's endpoint, also the `hf` engine's) with `--rollout-health-check-timeout`. An engine that fails
once is declared dead: `on_dead(index)` is called (the manager deregisters it from the router and stops its
server) and it is not probed again until `revive(index)`. While paused (weight pushes, released memory)
nothing is probed, so a busy or deliberately idle engine is not mistaken for a dead one, and `pause()` returns
only once the round of probes in progress has ended: a probe is a request the engine serves, and memory is
released only from an idle engine (SGLang's scheduler asserts it and its server dies).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import httpx

from slime.utils.http_utils import probe_get

logger = logging.getLogger(__name__)


class EngineHealthMonitor:
    def __init__(self, urls: Callable[[], list[str]], on_dead: Callable[[int], None], interval: float,
                 timeout: float, first_wait: float, headers: dict[str, str] | None = None):
        self._urls, self._on_dead = urls, on_dead
        self._headers = dict(headers or {})  # the engine key's Authorization header (--engine-api-key)
        self.interval, self.timeout, self.first_wait = interval, timeout, first_wait
        self._dead: set[int] = set()
        self._pauses = 0
        self._checking = False  # the background thread is in a round of probes (or taking a dead engine out)
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-health", daemon=True)

    def start(self) -> EngineHealthMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout + 5)

    def pause(self) -> None:
        """No probe from now on; returns once the background thread's round in progress has ended (its probe
        answered, a dead engine it found taken out), so no probe of ours is left in an engine."""
        with self._lock:
            self._pauses += 1
            if threading.current_thread() is not self._thread:  # called from on_dead: that round is the caller's
                self._lock.wait_for(lambda: not self._checking)

    def resume(self) -> None:
        with self._lock:
            self._pauses = max(0, self._pauses - 1)

    def dead(self) -> list[int]:
        with self._lock:
            return sorted(self._dead)

    def revive(self, index: int) -> None:
        with self._lock:
            self._dead.discard(index)

    def probe(self, url: str, generate: bool = True) -> bool:
        """GET /health_generate (one token), or with `generate=False` GET /health (the server answers: an engine
        whose KV cache is released must not generate; slime's SGLang servers answer /health without it)."""
        try:
            path = "/health_generate" if generate else "/health"
            return probe_get(url + path, timeout=self.timeout, headers=self._headers).status_code == 200
        except httpx.HTTPError:
            return False

    def check_once(self, while_paused: bool = False, generate: bool = True) -> list[int]:
        """Probe every live engine once; returns the indices found dead now. The background thread skips
        probes while paused; `while_paused` is for the caller that paused it and wants the answer now (the
        manager before a weight push: a server that died since the last periodic check must not be pushed to;
        `generate=False` while engines have their memory released)."""
        found = []
        for i, url in enumerate(self._urls()):
            with self._lock:
                if (self._pauses and not while_paused) or i in self._dead:
                    continue
            if self.probe(url, generate):
                continue
            with self._lock:
                if self._pauses and not while_paused:  # a push began while we waited: the answer proves nothing
                    continue
                self._dead.add(i)
            logger.warning("engine %d (%s) failed its health check (GET /health_generate, %.0f s); taking it out",
                           i, url, self.timeout)
            found.append(i)
            try:
                self._on_dead(i)
            except Exception as e:  # noqa: BLE001 - the monitor keeps watching the others
                logger.warning("taking engine %d out: %s", i, e)
        return found

    def _run(self) -> None:
        if self._stop.wait(self.first_wait):
            return
        while not self._stop.is_set():
            with self._lock:
                self._checking = not self._pauses
            if self._checking:
                try:
                    self.check_once()
                finally:
                    with self._lock:
                        self._checking = False
                        self._lock.notify_all()
            self._stop.wait(self.interval)
