"""Find processes a run may leave behind: engine servers, routers, Ray daemons, training workers."""

from __future__ import annotations

import time

import psutil

MARKERS = ("slime.backends.hf_engine", "sglang_router", "raylet", "gcs_server", "ray::")


def run_processes() -> dict[int, str]:
    found = {}
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            cmd = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(m in cmd for m in MARKERS):
            found[p.info["pid"]] = cmd[:200]
    return found


def wait_for_no_new_processes(before: dict[int, str], timeout_s: float = 30.0) -> dict[int, str]:
    """Processes that appeared since `before` and are still alive after `timeout_s` (empty when all reaped)."""
    deadline = time.time() + timeout_s
    while True:
        left = {pid: cmd for pid, cmd in run_processes().items() if pid not in before}
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)
