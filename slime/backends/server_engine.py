"""`ServerEngine`: one inference server process, driven over HTTP. The base of every rollout engine.

Used as a Ray actor (`ray.remote(num_cpus=...)(HFEngine).remote(args, rank)`), or directly in-process.
A subclass only says how to launch its server (`launch_command`) and which endpoint proves it ready
(`health_path`); starting, health-waiting, control calls and shutdown are shared. Control calls go
straight to the engine (sglang-router does not proxy weight updates, pause or abort); generation goes
through the router.

Process hygiene: the server runs in its own session (process group), so `shutdown` can signal every
process it spawned; on Linux it also gets PR_SET_PDEATHSIG=SIGKILL, so it dies when the thread that
started it dies (a killed Ray actor takes its server with it). Caveat of PDEATHSIG: it fires when the
*starting thread* exits, so call `init` from a thread that lives as long as the engine (a Ray actor's
method thread, or the main thread). `shutdown` is idempotent and also registered with `atexit`.

When the server fails, the error says why in its first line (`failure_report`): which engine (rank, URL), how
its process ended (exit code or signal), the most telling line of its own log (slime/utils/engine_logs.py: a
CUDA out-of-memory message, a CUDA error, a traceback's final line, ...), what to change, and the log's path;
the log's last lines follow on the next lines. Start-up failures, control calls that lose the server
(`EngineDiedError`, a weight push or a release / resume included) and the rollout manager's report of a failed
rollout all use it.

With `--engine-api-key` every call this class makes to its server (health waits, control calls, weight pushes)
carries `Authorization: Bearer <key>`; a subclass hands the key to its server (`launch_command` / `launch_env`).
The command line written to the engine's log shows `--api-key ***`.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import tempfile
import time

import httpx

from slime.utils.engine_logs import advice, exit_description, failure_kind, telling_line
from slime.utils.http_utils import bearer_headers, probe_get
from slime.utils.net import free_port, listener_pids, node_ip
from slime.utils.processes import shown_command, spawn, stop_process_group
from slime.weight_sync.delta import apply_push

_STARTUP_RETRIES = 3  # a freshly picked free port can be taken by someone else before the server binds it
_REPORT_READ_BYTES = 256 * 1024  # log read for the telling line: an OOM traceback can be followed by much more
_EXIT_WAIT_S = 3.0  # a lost connection can come just before the server process is gone: wait this long for it


class EngineHTTPError(RuntimeError):
    """An engine answered a control call with an error; the message is the server's."""


class EngineDiedError(EngineHTTPError):
    """A control call lost the engine's server because its process ended; the first line of the message is the
    engine's `failure_report()`, its log's last lines follow."""


class EngineNotIdleError(RuntimeError):
    """An engine still served requests when it had to be idle (before its memory is released)."""


def _process_name(pid: int) -> str:
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "gone"


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:2000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:2000]


class ServerEngine:
    """Owns one inference server process; used as a Ray actor (ray.remote(...)(HFEngine)), also usable directly."""

    name = "engine"
    startup_timeout_s = 600.0
    control_timeout_s = 120.0
    weight_update_timeout_s = 1800.0
    shutdown_grace_s = 10.0
    health_path = "/health"  # polled until it answers 200 (SGLang: /health_generate)
    health_probe_timeout_s = 5.0
    idle_timeout_s = 60.0  # wait_idle's default: how long requests left in the server may take to finish
    tp_size = 1  # tensor-parallel ranks of the server (payloads per update_weights_from_tensor)

    def __init__(self, args, rank: int):
        self.args = args
        self.rank = rank
        self.host = node_ip()
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.log_path: str | None = None
        self._client: httpx.Client | None = None
        atexit.register(self.shutdown)

    # ---- subclass hooks ----
    def launch_command(self, host: str, port: int) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} must implement launch_command(host, port)")

    def launch_env(self) -> dict[str, str]:
        return dict(os.environ)

    # ---- lifecycle ----
    def init(self) -> str:
        """Start the server and wait for GET `health_path`; returns its URL."""
        if self.process is not None and self.process.poll() is None:
            return self.get_url()
        for attempt in range(_STARTUP_RETRIES):
            self.port = free_port(self.host)
            self._start_process()
            try:
                self._wait_healthy()
                return self.get_url()
            except RuntimeError as e:
                self.shutdown()
                if "address already in use" in str(e).lower() and attempt + 1 < _STARTUP_RETRIES:
                    continue
                raise
        raise AssertionError("unreachable")

    def get_url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} rank {self.rank}: call init() first")
        return f"http://{self.host}:{self.port}"

    def shutdown(self) -> None:
        """SIGTERM the server's process group, wait, then SIGKILL. Safe to call many times."""
        proc, self.process = self.process, None
        if self._client is not None:
            self._client.close()
            self._client = None
        if proc is None:
            return
        stop_process_group(proc, self.shutdown_grace_s)

    def _start_process(self) -> None:
        cmd = self.launch_command(self.host, self.port)
        log_dir = os.environ.get("SLIME_ENGINE_LOG_DIR") or os.path.join(tempfile.gettempdir(), "slime_engine_logs")
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"{self.name}-rank{self.rank}-port{self.port}.log")
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shown_command(cmd)}\n".encode())
            log.flush()
            self.process = spawn(cmd, log, self.launch_env())

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        url = self.get_url() + self.health_path
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.failure_report(when=f'at start-up, before answering {url}')}\n"
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                if probe_get(url, timeout=self.health_probe_timeout_s, headers=self.auth_headers()).status_code == 200:
                    self._check_listener_is_ours(url)
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                line = telling_line(self._log_text())
                raise RuntimeError(f"{self._who()} did not answer {url} within {self.startup_timeout_s:.0f} s"
                                   + (f"; its log says: {line}" if line else "") + f"; log {self.log_path}\n"
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.2)

    def _check_listener_is_ours(self, url: str) -> None:
        """A port picked free can be taken by another server before this one binds it (two runs on one machine);
        that server may answer the health path too (sglang-router answers /health), and every call after would go to
        it. Raises "address already in use" (init picks another port) when only other processes listen there."""
        import psutil

        listeners = listener_pids(self.port)
        try:
            tree = psutil.Process(self.process.pid)
            ours = {tree.pid, *(child.pid for child in tree.children(recursive=True))}
        except psutil.NoSuchProcess:
            return  # it exited: the next poll reports how
        if listeners and not listeners & ours:
            names = ", ".join(sorted(f"{pid} ({_process_name(pid)})" for pid in listeners))
            raise RuntimeError(f"{self._who()}: address already in use: {url} was answered by another process "
                               f"listening on port {self.port} (pid {names}), which took the port after it was "
                               "picked free, not by this engine's server")

    def log_tail(self, n_bytes: int = 4000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - n_bytes))
            return f.read().decode(errors="replace")

    # ---- why it failed ----
    def log_size(self) -> int:
        """Bytes in the server's log so far: pass it back as `failure_report(since=...)` to look only at what the
        server logged after this moment."""
        return os.path.getsize(self.log_path) if self.log_path and os.path.exists(self.log_path) else 0

    def _log_text(self, since: int = 0) -> str:
        """The log from byte `since` (at most its last _REPORT_READ_BYTES); from its start when it is shorter than
        `since` (a restarted server writes a new log)."""
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        size = os.path.getsize(self.log_path)
        with open(self.log_path, "rb") as f:
            f.seek(max(since if since <= size else 0, size - _REPORT_READ_BYTES))
            return f.read().decode(errors="replace")

    def _who(self) -> str:
        where = self.get_url() if self.port is not None else "not started"
        return f"{self.name} rank {self.rank} ({where})"

    def death_report(self) -> str | None:
        """None while the server process runs (or was never started, or was stopped by `shutdown`); once it has
        ended, one line: which engine, its exit code or signal, its log's telling line, the fix, the log's path."""
        if self.process is None or self.process.poll() is None:
            return None
        return self.failure_report()

    def failure_report(self, since: int | None = None, when: str = "", settle_s: float = 0.0) -> str | None:
        """`death_report`'s line when the server has ended; while it runs, the same line about the most telling
        error it logged after byte `since` of its log (None: nothing telling, or `since` not given); None when no
        server was started or `shutdown` stopped it. `when` goes after the exit description ("at start-up").
        `settle_s`: a server that failed a check may be dying (a SIGKILL's exit takes a moment on a busy machine):
        wait up to this long for its exit before reporting it as running."""
        if self.process is None:  # never started, or stopped by `shutdown`
            return None
        rc = self.process.poll()
        if rc is None and settle_s > 0:
            try:
                rc = self.process.wait(timeout=settle_s)
            except subprocess.TimeoutExpired:
                pass
        alive = rc is None
        if alive and since is None:
            return None
        line = telling_line(self._log_text(since or 0))
        if alive and line is None:
            return None
        args = self.args
        kind = failure_kind(line, rc)
        fix = advice(kind, backend=args.rollout_backend, colocate=args.colocate,
                     offload_rollout=args.offload_rollout, offload_train=args.offload_train)
        state = "is running but logged an error" if alive else exit_description(rc)
        said = line.rstrip(".") if line else "its log shows no error"
        return (f"{self._who()} {state}{' ' + when if when else ''}: {said}" + (f". Fix: {fix}" if fix else "")
                + f". Log: {self.log_path}")

    def status(self, since: int | None = None) -> dict:
        """{"alive": the server process runs, "report": `failure_report(since)`} in one call (the rollout manager's
        question after a failed rollout)."""
        return {"alive": self.process is not None and self.process.poll() is None,
                "report": self.failure_report(since)}

    def _lost_server(self, what: str, error: Exception) -> EngineHTTPError:
        """The error for a control call whose connection failed: `EngineDiedError` with the engine's report when
        its process ended (waiting briefly: the connection can drop a moment before the process is gone)."""
        if self.process is not None:
            try:
                self.process.wait(_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        report = self.death_report()
        if report is None:
            return EngineHTTPError(f"{what} failed: {type(error).__name__}: {error}")
        return EngineDiedError(f"{report}\n({what} failed: {type(error).__name__}: {error})\n"
                               f"last lines of {self.log_path}:\n{self.log_tail()}")

    # ---- HTTP ----
    def auth_headers(self) -> dict[str, str]:
        """The Authorization header of `--engine-api-key` ({} without a key)."""
        return bearer_headers(self.args.engine_api_key)

    def _http(self) -> httpx.Client:
        if self._client is None:
            # trust_env=False: engines are reached directly, never through an HTTP(S)_PROXY from the env
            self._client = httpx.Client(base_url=self.get_url(), timeout=self.control_timeout_s,
                                        headers=self.auth_headers(), trust_env=False)
        return self._client

    def _call(self, method: str, path: str, json: dict | None = None, timeout: float | None = None):
        try:
            resp = self._http().request(method, path, json=json, timeout=timeout or self.control_timeout_s)
        except httpx.TransportError as e:
            raise self._lost_server(f"{self.name} rank {self.rank} {method} {self.get_url()}{path}", e) from e
        if resp.status_code >= 400:
            raise EngineHTTPError(f"{self.name} rank {self.rank} {method} {path} -> HTTP {resp.status_code}: "
                                  f"{_error_message(resp)}")
        try:
            body = resp.json()
        except ValueError:
            return resp.text
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineHTTPError(f"{self.name} rank {self.rank} {method} {path} failed: {_error_message(resp)}")
        return body

    # ---- control calls ----
    def update_weights_from_tensor(self, serialized_bucket: str | list[str], weight_version: str,
                                   load_format: str = "flattened_bucket", flush_cache: bool = True) -> dict:
        """Load one bucket (`serialize_bucket(flatten_bucket(named))`). SGLang takes one payload per engine
        TP rank: a single payload is repeated `tp_size` times (every rank opens the same handle), a list is
        sent as given. The caller keeps the flattened bucket alive until this returns: the payload holds
        handles to its memory, not a copy. `flush_cache` (SGLang's default, True) empties the prefix cache after
        loading: without it SGLang keeps serving prompts from KV computed with the old weights (seen on the
        H200: log-probs 0.12 nats off the trainer's after every push)."""
        payloads = [serialized_bucket] * self.tp_size if isinstance(serialized_bucket, str) else list(serialized_bucket)
        return self._call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": payloads, "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version}, timeout=self.weight_update_timeout_s)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        """Join the trainer's broadcast group (the trainer is rank 0 and must join at the same time: call
        this asynchronously, e.g. as a Ray actor method, then join from the trainer). This engine's TP
        ranks take group ranks `rank_offset ..`."""
        return self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend},
            timeout=self.weight_update_timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None) -> dict:
        """Receive `names` (in this order) by broadcast from group rank 0; the trainer broadcasts them while
        this call waits. `dtypes` are torch dtypes or their names ("bfloat16")."""
        return self._call("POST", "/update_weights_from_distributed", {
            "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": None if weight_version is None else str(weight_version)},
            timeout=self.weight_update_timeout_s)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> dict:
        return self._call("POST", "/update_weights_from_disk",
                          {"model_path": model_path, "weight_version": weight_version},
                          timeout=self.weight_update_timeout_s)

    # ---- LoRA adapters (SGLang's endpoints; the hf engine's: slime/backends/hf_engine/lora.py) ----
    def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict, serialized_tensors: str,
                                       weight_version: str | None = None) -> dict:
        """Load (or replace) adapter `lora_name` from `serialize_bucket(flatten_bucket(named))` of its PEFT-named
        tensors, with PEFT's adapter_config fields in `config_dict`."""
        return self._call("POST", "/load_lora_adapter_from_tensors", {
            "lora_name": lora_name, "config_dict": config_dict, "serialized_tensors": serialized_tensors,
            "load_format": "flattened_bucket", "weight_version": weight_version}, timeout=self.weight_update_timeout_s)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        return self._call("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path},
                          timeout=self.weight_update_timeout_s)

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    def apply_weight_delta(self, push_dir: str, local_dir: str, weight_version: str) -> dict:
        """--update-weight-mode delta, on the engine's host (this actor runs there): bring `local_dir`
        (--update-weight-local-checkpoint-dir) to the push in `push_dir` (a full checkpoint copied, or a delta
        decoded; every tensor's checksum checked before any file is replaced: slime/weight_sync/delta.py
        `apply_push`), then load `local_dir` (`update_weights_from_disk`; SGLang itself is not changed).
        A failed check raises before anything changed here or in the server."""
        applied = apply_push(push_dir, local_dir)
        self.update_weights_from_disk(local_dir, weight_version)
        return applied

    def check_weights(self, action: str) -> dict:
        """SGLang's `POST /weights_checker`: "snapshot" copies every parameter, "reset_tensors" overwrites them
        (only a complete push restores them), "compare" fails (EngineHTTPError naming each differing tensor)
        unless all equal the snapshot; "checksum" hashes them. Used by --check-weight-update-equal."""
        return self._call("POST", "/weights_checker", {"action": action}, timeout=self.weight_update_timeout_s)

    def get_weight_version(self) -> str:
        """The version stamped by the last weight update. SGLang 0.5.16 serves it in `/model_info` only
        (its `/get_weight_version` answers 404)."""
        return self.get_model_info()["weight_version"]

    def get_model_info(self) -> dict:
        return self._call("GET", "/model_info")

    def get_server_info(self) -> dict:
        return self._call("GET", "/server_info")  # /get_server_info is SGLang's deprecated alias

    def flush_cache(self):
        return self._call("POST", "/flush_cache")

    def abort_all(self):
        return self._call("POST", "/abort_request", {"abort_all": True})

    def pause_generation(self, mode: str | None = None):
        """Stop generating until `continue_generation`. SGLang's default mode ("abort", also when `mode` is
        None) aborts the requests in flight and returns once they are answered; "in_place" / "retract" keep them."""
        return self._call("POST", "/pause_generation", {"mode": mode} if mode else {})

    def continue_generation(self):
        return self._call("POST", "/continue_generation", {})

    def release_memory_occupation(self, tags=None):
        """Free GPU memory by tag ("weights", "kv_cache", "cuda_graph"; none: all). The server must be idle.
        SGLang (without --enable-weights-cpu-backup) does not keep released weights: push them again after
        `resume_memory_occupation(["weights"])`."""
        return self._call("POST", "/release_memory_occupation", {"tags": tags} if tags else {})

    def resume_memory_occupation(self, tags=None):
        return self._call("POST", "/resume_memory_occupation", {"tags": tags} if tags else {})

    def get_load(self) -> list[dict]:
        """SGLang's GET /get_load: one entry per data-parallel rank, `num_reqs` (running + waiting) and
        `num_waiting_reqs` among its fields."""
        loads = self._call("GET", "/get_load")
        if not isinstance(loads, list) or not all(isinstance(x, dict) and "num_reqs" in x for x in loads):
            raise EngineHTTPError(f"{self.name} rank {self.rank} GET /get_load answered {str(loads)[:300]!r}; "
                                  "expected a list of {dp_rank, num_reqs, num_waiting_reqs, ...} (SGLang's shape)")
        return loads

    def wait_idle(self, timeout: float | None = None) -> None:
        """Return once the server serves no request. Memory is released only from an idle engine (SGLang's
        scheduler asserts `is_fully_idle()` and its server dies). `POST /flush_cache?timeout=T` asks the scheduler
        itself: SGLang 0.5.16 answers 200 the moment it is fully idle (checked in its own loop, the condition the
        release asserts) and 400 if it is not within T; an SGLang without deferred flushes answers 400 at once
        while busy, so 400 is polled until `timeout` seconds (default `idle_timeout_s`) have passed. GET /get_load
        cannot tell: SGLang publishes it as a snapshot (after each prefill, on idle turns and every 15th decode
        step), so it reads 0 while a request prefilled alone runs. Raises EngineNotIdleError with the load, the
        flush's answer and the server's log when it is still busy after `timeout`."""
        timeout = self.idle_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        what = f"{self.name} rank {self.rank} POST {self.get_url()}/flush_cache"
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:
                resp = self._http().post("/flush_cache", params={"timeout": round(left, 3)},
                                         timeout=left + self.control_timeout_s)
            except httpx.TransportError as e:
                raise self._lost_server(what, e) from e
            if resp.status_code == 200:
                return
            if resp.status_code != 400:
                raise EngineHTTPError(f"{what} -> HTTP {resp.status_code}: {_error_message(resp)}")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        busy = [x for x in self.get_load() if x["num_reqs"]]
        counts = "; ".join(f"dp rank {x.get('dp_rank', 0)}: {x['num_reqs']} request(s), "
                           f"{x.get('num_waiting_reqs', 0)} of them waiting" for x in busy) or "GET /get_load reads 0"
        raise EngineNotIdleError(
            f"{self.name} rank {self.rank} ({self.get_url()}) still serves requests after {timeout:.0f} s ({counts}; "
            f"/flush_cache: {resp.text.strip()[:200]!r}), so its memory cannot be released (SGLang's scheduler "
            "asserts it is idle and its server dies). Something left requests in it: a rollout function that "
            "returned with requests in flight (abort them first: POST /abort_request {\"abort_all\": true}), "
            f"generation paused in place, or a client that gave up on a request it sent. Log {self.log_path}:\n"
            f"{self.log_tail()}")

    def health_generate(self, timeout: float) -> bool:
        """True when the server generated one token within `timeout` seconds."""
        try:
            resp = probe_get(self.get_url() + "/health_generate", timeout=timeout, headers=self.auth_headers())
            return resp.status_code == 200
        except (httpx.HTTPError, RuntimeError):
            return False
