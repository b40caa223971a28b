"""Start N rank processes of a worker script over a real gloo process group and read rank 0's result.

A failed rank (the others would wait on a collective) or a hang past the timeout kills them all; the
test fails with the tail of every rank's log.

Without CUDA the ranks are forked from a zygote: one process per worker script (and environment) that has run the
script's top level once (torch, megatron-core and the CPU shim: ~6 s of imports a process on a CI core) and then
forks a fresh rank per request. Each rank then runs the script as `python worker.py ...` would (`__main__`, its
argv, its log as stdout and stderr, the exit handlers run at the end); only the imports are not done again. With
CUDA (tests/gpu) the ranks are plain processes: a forked process must not inherit a CUDA runtime."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback

import psutil
import pytest
import torch

from slime.utils.net import free_port
from tests.conftest import REPO_ROOT


def worker_parser() -> argparse.ArgumentParser:
    """The flags `run_ranks` passes to every worker (plus --model, the HF folder all workers train)."""
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    return p


def write_result(cli: argparse.Namespace, result: dict) -> None:
    """Rank 0 writes the worker's `result` where `run_ranks` reads it; other ranks write nothing."""
    if cli.rank == 0:
        with open(os.path.join(cli.out, "result.json"), "w") as f:
            json.dump(result, f)


def write_prompt_file(cli: argparse.Namespace) -> str:
    """<out>/prompts.jsonl with one prompt (the workers' --prompt-data, which parse_args reads), written by every
    rank whole under a name of its own and renamed into place: the ranks start together, and one must never read
    the file while another has it truncated."""
    path = os.path.join(cli.out, "prompts.jsonl")
    mine = f"{path}.rank{cli.rank}"
    with open(mine, "w") as f:
        f.write('{"prompt": "1+1?", "label": "2"}\n')
    os.replace(mine, path)
    return path


def run_ranks(worker: str, world_size: int, out_dir: str, extra: list[str], timeout_s: float = 240) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    port = free_port()
    env = dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
               TOKENIZERS_PARALLELISM="false")
    procs = []
    gpus = torch.cuda.device_count()
    try:
        for rank in range(world_size):
            argv = ["--world-size", str(world_size), "--rank", str(rank), "--port", str(port), "--out", out_dir, *extra]
            log_path = os.path.join(out_dir, f"rank{rank}.log")
            if gpus == 0:
                procs.append(fork_script(worker, worker, argv, log_path, env))
                continue
            if gpus >= world_size:  # one GPU per rank, as Ray gives each training actor
                env["CUDA_VISIBLE_DEVICES"] = str(rank)
            with open(log_path, "w") as log:  # the child keeps its own handle
                procs.append(subprocess.Popen([sys.executable, worker, *argv], stdout=log, stderr=subprocess.STDOUT,
                                              env=env, cwd=REPO_ROOT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if any(p.returncode != 0 for p in procs):
        tails = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.log")) as f:
                tails.append(f"--- rank {rank} (rc {procs[rank].returncode}) ---\n" + f.read()[-4000:])
        pytest.fail(f"{os.path.basename(worker)} failed:\n" + "\n".join(tails))
    with open(os.path.join(out_dir, "result.json")) as f:
        return json.load(f)


class _ForkedRank:
    """A process forked by a zygote (not our child: the kernel reaps it). Its exit code is the file it writes as
    it exits; gone without one, a signal ended it (reported as -9, SIGKILL's `Popen` code: which one is unknown)."""

    def __init__(self, pid: int, rc_path: str):
        self.pid, self._rc_path, self.returncode = pid, rc_path, None

    def poll(self):
        if self.returncode is None and not _alive(self.pid):  # gone: its exit code file is complete, if any
            self.returncode = -signal.SIGKILL
            if os.path.exists(self._rc_path):
                with open(self._rc_path) as f:
                    self.returncode = int(f.read())
        return self.returncode

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self):
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Zygote:
    """The pytest side of one zygote process (`python -m tests.e2e_cpu.ranks --zygote PRELOAD`): one fork request
    at a time."""

    def __init__(self, preload: str, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e_cpu.ranks", "--zygote", preload], env=env,
                                     cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()

    def fork(self, script: str, argv: list[str], log_path: str) -> _ForkedRank:
        rc_path = log_path + ".rc"
        if os.path.exists(rc_path):
            os.remove(rc_path)
        request = {"script": os.path.abspath(script), "argv": argv, "log": log_path, "rc": rc_path}
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the rank zygote of {self.proc.args[-1]} exited (rc {self.proc.wait()}) before forking")
        return _ForkedRank(json.loads(reply)["pid"], rc_path)

    def close(self):
        if not self.proc.stdin.closed:
            self.proc.stdin.close()  # the zygote exits at the end of its input
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_ZYGOTES: dict = {}
_ZYGOTES_LOCK = threading.Lock()


def fork_script(preload: str, script: str, argv: list[str], log_path: str, env: dict) -> _ForkedRank:
    """`python SCRIPT ARGV` (cwd the repository, output to `log_path`) forked from the zygote that ran the top
    level of `preload` under `env` (started on first use). `preload`'s imports must be the first thing SCRIPT does
    (the same script, or one whose imports SCRIPT repeats: a worker that installs the CPU shim, for a script run
    by the shim). Returns a handle with poll / wait / kill / returncode, as `subprocess.Popen`'s."""
    key = (os.path.abspath(preload), tuple(sorted(env.items())))
    with _ZYGOTES_LOCK:
        if key not in _ZYGOTES or _ZYGOTES[key].proc.poll() is not None:
            _ZYGOTES[key] = _Zygote(os.path.abspath(preload), env)
        zygote = _ZYGOTES[key]
    return zygote.fork(script, argv, log_path)


def run_script(preload: str, script: str, argv: list[str], log_path: str, env: dict, timeout_s: float) -> int:
    """`python SCRIPT ARGV` run to its end (killed past `timeout_s`), its output in `log_path`; returns its exit
    code. Without CUDA forked (`fork_script`), with CUDA a plain process."""
    if torch.cuda.device_count():
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, script, *argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=REPO_ROOT)
    else:
        proc = fork_script(preload, script, argv, log_path, env)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    return proc.wait()


@atexit.register
def _close_zygotes():
    for z in _ZYGOTES.values():
        z.proc.stdin.close()  # all at once: each zygote exits at the end of its input
    for z in _ZYGOTES.values():
        z.close()


def _serve(preload: str) -> None:
    """The zygote: run the preload script's top level (its imports), then fork a process per request line on stdin
    ({"script", "argv", "log", "rc"}), answering {"pid"} on stdout; exit at the end of stdin. Forked processes are
    reaped by the kernel (SIGCHLD ignored): each writes its own exit code."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to stderr, not into the replies
    sys.path[0] = os.path.dirname(preload)  # as `python PRELOAD` has it
    runpy.run_path(preload, run_name="__rank_zygote__")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()  # the rank must not hold the zygote's answer pipe
            _run_script(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
    # nothing of the zygote's own needs finalising (the ranks ran their exit handlers): skip the interpreter's
    # teardown of torch and megatron-core (~1.5 s)
    sys.stderr.flush()
    os._exit(0)


def _run_script(request: dict) -> None:
    """In the forked child: become `python SCRIPT ARGV` with its output in the log; never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the rank waits for its own children (an engine server)
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(0, closefd=False)
        script = request["script"]
        sys.argv = [script, *request["argv"]]
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - printed as Python prints an uncaught one
            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            with open(request["rc"] + ".tmp", "w") as f:
                f.write(str(code))
            os.replace(request["rc"] + ".tmp", request["rc"])
        finally:
            os._exit(code)


if __name__ == "__main__" and sys.argv[1:2] == ["--zygote"]:
    _serve(sys.argv[2])
