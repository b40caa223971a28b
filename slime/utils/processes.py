"""Child processes that die with their owner (servers, routers)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
SECRET_FLAGS = ("--api-key",)  # values that never go into a log or an error message


def die_with_parent_preexec():
    """A `preexec_fn` asking the kernel to SIGKILL the child when its parent dies, so a crashed (or SIGKILLed)
    owner never leaves a server behind. libc is resolved here, in the parent: the forked child only calls
    into it. Linux only (None elsewhere). PDEATHSIG follows the *thread* that forked, so start the child from a
    thread that lives as long as its owner (a Ray actor's method thread, or the main thread)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def shown_command(cmd: list[str]) -> str:
    """`cmd` as one line for logs and errors, the value of every flag in SECRET_FLAGS replaced by `***`."""
    out = []
    for i, part in enumerate(cmd):
        if i and cmd[i - 1] in SECRET_FLAGS:
            out.append("***")
        elif part.startswith(tuple(f + "=" for f in SECRET_FLAGS)):
            out.append(part.split("=", 1)[0] + "=***")
        else:
            out.append(part)
    return " ".join(out)


def spawn(cmd: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` in a session (process group) of its own, stdout and stderr to the open file `log`, dying with
    this process (PDEATHSIG, see above): `stop_process_group` then reaches everything it spawns."""
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True, preexec_fn=die_with_parent_preexec())  # noqa: PLW1509


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the leader's pid
    except (ProcessLookupError, PermissionError):
        pass


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group `spawn` made, wait up to `grace_s`, then SIGKILL the group (children the
    leader spawned are reached even once the leader has exited)."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
