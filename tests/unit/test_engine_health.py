"""The fault-tolerance health monitor's probes (slime/ray/engine_health.py) against a real HTTP server."""

from __future__ import annotations

import http.server
import threading

from slime.ray.engine_health import EngineHealthMonitor


class _Recorder(http.server.BaseHTTPRequestHandler):
    paths: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).paths.append(self.path)
        self.send_response(200 if self.path == "/health" else 503)  # a server that cannot generate now
        self.end_headers()

    def log_message(self, *args):
        pass


def test_probe_generates_unless_memory_is_released():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    dead = []
    monitor = EngineHealthMonitor(lambda: [url], dead.append, interval=60, timeout=5, first_wait=60)
    try:
        monitor.pause()  # as the rollout manager does while engines are released and before a push
        assert monitor.check_once(while_paused=True, generate=False) == [] and dead == []  # liveness: /health
        assert _Recorder.paths == ["/health"]
        assert monitor.check_once(while_paused=True) == [0] and dead == [0]  # /health_generate failing: dead
        assert _Recorder.paths == ["/health", "/health_generate"]
    finally:
        server.shutdown()
        server.server_close()
