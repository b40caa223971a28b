"""`ServerEngine`'s control calls on the wire, against a scripted HTTP peer that records what it is sent and
answers as SGLang 0.5.16 does (docs/sglang_backend.md, "Differences found"). The peer stands in for nothing users
run: it checks the request shapes our client builds."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime.backends.server_engine import EngineHTTPError, ServerEngine
from slime.backends.sglang_utils.sglang_engine import SGLangEngine
from slime.utils.net import free_port, listener_pids
from tests.args import make_args


class Peer(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *a):
        pass

    def _answer(self, status: int, body) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        if data:
            self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.seen.append(("GET", self.path, None))
        if self.path == "/model_info":
            self._answer(200, {"model_path": "/m", "is_generation": True, "weight_version": "7"})
        elif self.path == "/server_info":
            self._answer(200, {"tp_size": 1, "weight_version": "7"})
        else:  # /get_weight_version: 404 in SGLang 0.5.16
            self._answer(404, {"detail": "Endpoint '/get_weight_version' is deprecated. Please use '/model_info'"})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(("POST", self.path, json.loads(raw) if raw else None))
        if self.path == "/update_weights_from_disk":
            self._answer(400, {"success": False, "message": "no such folder"})
        elif self.path in ("/abort_request", "/release_memory_occupation", "/resume_memory_occupation"):
            self._answer(200, None)  # SGLang: an empty 200 (release/resume: null)
        else:
            self._answer(200, {"success": True, "message": "ok"})


@pytest.fixture
def engine():
    Peer.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    eng = ServerEngine(make_args(), rank=0)
    eng.host, eng.port = "127.0.0.1", server.server_address[1]
    yield eng
    eng.shutdown()
    server.shutdown()


def test_weight_version_and_info_come_from_the_current_endpoints(engine):
    assert engine.get_weight_version() == "7"
    assert engine.get_server_info()["tp_size"] == 1
    assert [(m, p) for m, p, _ in Peer.seen] == [("GET", "/model_info"), ("GET", "/server_info")]


def test_weight_updates_flush_the_prefix_cache_by_default(engine):
    """SGLang's default, and needed: without a flush it serves prompts from KV computed with the old weights."""
    engine.update_weights_from_tensor("payload", weight_version="3")
    engine.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 2]], weight_version="3")
    tensor, dist = (body for _, _, body in Peer.seen)
    assert tensor == {"serialized_named_tensors": ["payload"], "load_format": "flattened_bucket",
                      "flush_cache": True, "weight_version": "3"}
    assert dist["flush_cache"] is True and dist["dtypes"] == ["bfloat16"] and dist["weight_version"] == "3"


def test_pause_modes_memory_tags_and_empty_answers(engine):
    assert engine.pause_generation() == {"success": True, "message": "ok"}
    engine.pause_generation("in_place")
    assert engine.abort_all() == ""  # an empty 200 is a success
    engine.release_memory_occupation()
    engine.resume_memory_occupation(["weights"])
    assert [(p, b) for _, p, b in Peer.seen] == [
        ("/pause_generation", {}), ("/pause_generation", {"mode": "in_place"}),
        ("/abort_request", {"abort_all": True}), ("/release_memory_occupation", {}),
        ("/resume_memory_occupation", {"tags": ["weights"]})]


def test_a_refused_update_raises_with_the_servers_message(engine):
    with pytest.raises(EngineHTTPError, match=r"update_weights_from_disk -> HTTP 400: no such folder"):
        engine.update_weights_from_disk("/nowhere", weight_version="2")


def test_sglang_lora_push_replaces_the_adapter_and_restamps_the_version():
    """SGLang refuses to load a name it holds and takes no weight version with an adapter: each push after the
    first unloads the previous adapter, loads the new one and restamps the version without aborting requests."""
    Peer.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    eng = SGLangEngine(make_args(), rank=0)
    eng.host, eng.port = "127.0.0.1", server.server_address[1]
    try:
        for version in ("1", "2"):
            eng.load_lora_adapter_from_tensors("slime_lora", {"r": 8, "lora_alpha": 16}, f"payload{version}", version)
    finally:
        eng.shutdown()
        server.shutdown()
    load = {"lora_name": "slime_lora", "config_dict": {"r": 8, "lora_alpha": 16}, "load_format": "flattened_bucket"}
    assert [(p, b) for _, p, b in Peer.seen] == [
        ("/load_lora_adapter_from_tensors", {**load, "serialized_tensors": "payload1", "weight_version": "1"}),
        ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
        ("/unload_lora_adapter", {"lora_name": "slime_lora"}),
        ("/load_lora_adapter_from_tensors", {**load, "serialized_tensors": "payload2", "weight_version": "2"}),
        ("/update_weight_version", {"new_version": "2", "abort_all_requests": False})]


SERVE_AFTER_A_WHILE = """
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
time.sleep(1.0)  # the imports of a real server: the port is free for someone else meanwhile
HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class Health(BaseHTTPRequestHandler):  # another run's server: it answers the health path as the engine would
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


class DelayedServer(ServerEngine):
    def launch_command(self, host, port):
        return [sys.executable, "-c", SERVE_AFTER_A_WHILE, str(port)]


def test_a_port_taken_by_another_server_before_the_bind_is_not_mistaken_for_the_engine(monkeypatch, tmp_path):
    """Two runs on one machine: the port picked free for an engine is taken by the other run's server before the
    engine's binds it, and that server answers the health path too. init() must not take it for the engine."""
    monkeypatch.setenv("SLIME_ENGINE_LOG_DIR", str(tmp_path))
    other = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    picks = iter([taken])
    monkeypatch.setattr("slime.backends.server_engine.free_port", lambda host: next(picks, None) or free_port(host))
    eng = DelayedServer(make_args(), rank=0)
    eng.host = "127.0.0.1"
    try:
        url = eng.init()
        assert url != f"http://127.0.0.1:{taken}" and eng.port != taken
        assert listener_pids(eng.port) == {eng.process.pid}
        assert (tmp_path / f"{eng.name}-rank0-port{taken}.log").is_file()  # the first start, stopped for the port
    finally:
        eng.shutdown()
        other.shutdown()


def test_the_engines_actors_import_without_torch():
    """An engine's Ray actor only launches and talks to its server: without torch in its imports (and dtype names,
    not torch dtypes, in the pushes it is handed) each engine start spares ~1.5 s of CPU and ~175 MB
    (measured: 43 against 218 MB resident after the imports)."""
    import subprocess

    code = ("import sys; sys.modules['torch'] = None; import slime.backends.hf_engine.engine, "
            "slime.backends.sglang_utils.sglang_engine")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
