"""RouterClient against a scripted HTTP peer (not sglang-router: the replies a real router gave once in CI and we
cannot provoke on demand). An add that the router accepts without a JSON body is decided by the router's worker
list, as every add is; a refused add still fails with the router's answer."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime.rollout.router import RouterClient


def _peer(add_status: int, add_body: bytes):
    listed: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            length = int(self.headers.get("Content-Length", 0))
            url = json.loads(self.rfile.read(length))["url"]
            if add_status < 300:
                listed.append(url)
            self._reply(add_status, add_body)

        def do_GET(self):
            self._reply(200, json.dumps({"workers": [{"id": None, "url": u} for u in listed]}).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("body", [b"", b"OK", b'{"worker_id": "w1"}'])
def test_an_accepted_add_is_decided_by_the_worker_list(body):
    server = _peer(202, body)
    try:
        client = RouterClient(f"http://127.0.0.1:{server.server_port}")
        worker_id = client.add_worker("http://127.0.0.1:30000", timeout=5)
        assert worker_id == ("w1" if body.startswith(b"{") else None)
        assert client.list_workers() == ["http://127.0.0.1:30000"]
    finally:
        server.shutdown()


def test_a_refused_add_fails_with_the_routers_answer():
    server = _peer(400, b"no such worker")
    try:
        client = RouterClient(f"http://127.0.0.1:{server.server_port}")
        with pytest.raises(RuntimeError, match="answered 400: no such worker"):
            client.add_worker("http://127.0.0.1:30000", timeout=5)
    finally:
        server.shutdown()
