"""The health monitor's `pause()` returns only once its probe in flight is answered (slime/ray/engine_health.py):
a probe is a one-token generation the engine serves, and the rollout manager releases engine memory right after
pausing the monitor (SGLang's scheduler asserts it is idle then). Against a real HTTP server that holds the probe's
answer until the test lets it go."""

from __future__ import annotations

import http.server
import threading
import time

from slime.ray.engine_health import EngineHealthMonitor


class _HeldProbe(http.server.BaseHTTPRequestHandler):
    entered = threading.Event()
    answer = threading.Event()
    probes = 0

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).probes += 1
        type(self).entered.set()
        type(self).answer.wait(30)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_pause_waits_for_the_probe_in_flight_and_stops_probing():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HeldProbe)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    dead: list[int] = []
    monitor = EngineHealthMonitor(lambda: [url], dead.append, interval=0.01, timeout=30, first_wait=0).start()
    try:
        assert _HeldProbe.entered.wait(10), "the monitor never probed"
        paused = threading.Event()
        threading.Thread(target=lambda: (monitor.pause(), paused.set()), daemon=True).start()
        assert not paused.wait(0.5), "pause() returned while the probe was still unanswered"
        _HeldProbe.answer.set()
        assert paused.wait(10), "pause() did not return once the probe was answered"
        probes = _HeldProbe.probes
        time.sleep(0.3)
        assert _HeldProbe.probes == probes and dead == []  # paused: no probe, and the answered one was healthy
        monitor.resume()
        deadline = time.monotonic() + 10
        while _HeldProbe.probes == probes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _HeldProbe.probes > probes, "the monitor did not probe again after resume()"
    finally:
        _HeldProbe.answer.set()
        monitor.stop()
        server.shutdown()
        server.server_close()
