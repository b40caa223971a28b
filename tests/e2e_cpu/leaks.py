"""Find processes a run may leave behind: engine servers, routers, Ray daemons, training workers.

Only processes started from this test session count: importing this module puts a tag into the environment,
which every child process (train.py runs, Ray daemons and workers, engine servers, routers) inherits. Other
sessions running on the same machine carry another tag, or none, and are ignored. The tag names the pytest-xdist
worker (PYTEST_XDIST_WORKER; "main" without xdist) and the process that made it, plus a random part: a tag found
in the environment is kept only when this process made it (the module imported twice), never when it was
inherited, so workers of one `pytest -n` run, or a pytest session started from inside another one, never share a
tag and never count each other's processes.
"""

from __future__ import annotations

import os
import time
import uuid

import psutil

TAG_VAR = "SLIME_TEST_SESSION_TAG"


def _own_tag() -> str:
    """This process's tag: `<xdist worker>:<pid>:<random>`, the one already in the environment when this process
    set it, otherwise a new one (an inherited tag belongs to the parent's session)."""
    tag = os.environ.get(TAG_VAR, "")
    parts = tag.split(":")
    if len(parts) == 3 and parts[1] == str(os.getpid()):
        return tag
    return f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}:{os.getpid()}:{uuid.uuid4().hex}"


os.environ[TAG_VAR] = _own_tag()
MARKERS = ("slime.backends.hf_engine", "sglang_router", "raylet", "gcs_server", "ray::", "train.py")


def run_processes() -> dict[int, str]:
    """This session's live run processes (pid -> command line), the calling process excluded."""
    tag, me = os.environ[TAG_VAR], os.getpid()
    found = {}
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            if p.info["pid"] == me or p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
            if any(m in cmd for m in MARKERS) and p.environ().get(TAG_VAR) == tag:
                found[p.info["pid"]] = cmd[:200]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for_no_new_processes(before: dict[int, str], timeout_s: float = 30.0) -> dict[int, str]:
    """Processes that appeared since `before` and are still alive after `timeout_s` (empty when all reaped)."""
    deadline = time.time() + timeout_s
    while True:
        left = {pid: cmd for pid, cmd in run_processes().items() if pid not in before}
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)
