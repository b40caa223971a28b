"""A watchdog that kills the processes of a local Ray cluster when the driver that started it dies abruptly.

`ray.init()` starting a local cluster ties `gcs_server` and `raylet` to the driver (PR_SET_PDEATHSIG), and
Ray's workers exit once their raylet is gone. The two agents the raylet starts (`ray::DashboardAgent`,
`ray::RuntimeEnvAgent`) do not follow at once: when the raylet dies without SIGTERM they first report its
death to the GCS, which is dead too, and block there for 60 s (Ray 2.x `report_raylet_error_logs` ->
`publish_error_to_driver(..., timeout 60)`). So a SIGKILLed driver (OOM killer, `kill -9`, a lost node) left
them running for a minute, measured by benchmarks/driver_kill_trials.py.

`watch(pids)` starts `python -m slime.utils.process_reaper` in its own session, holding the read end of a
pipe whose write end only the driver has (close-on-exec, so no process the driver starts inherits it). When
the driver dies, or calls `Reaper.release()` after a clean `ray.shutdown()`, the pipe reaches EOF and the
reaper SIGKILLs whichever of the watched processes, and of their descendants, are still alive, then exits.
A pid is only killed when its start time is still the recorded one (no victim of pid reuse).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

def _identity(proc: psutil.Process) -> str | None:
    try:
        return f"{proc.pid}:{proc.create_time()!r}"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def ray_node_processes() -> list[psutil.Process]:
    """The processes of the local Ray cluster this process started, as they are now: gcs_server, raylet,
    the raylet's agents, log monitor, idle workers (Ray's files or a `ray::` title in their command line;
    other children of the caller, e.g. a test's engine server, are left out)."""
    import ray

    ray_dir = os.path.dirname(os.path.abspath(ray.__file__))
    found = []
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in children:
        try:
            cmd = p.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if cmd and (cmd[0].startswith("ray::") or any(ray_dir in part for part in cmd)):
            found.append(p)
    return found


class Reaper:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def release(self, timeout: float = 10.0) -> None:
        """Close the pipe: the reaper kills what is left of the watched processes and exits. Idempotent."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def watch(processes: list[psutil.Process]) -> Reaper | None:
    """Start a reaper for `processes` (and whatever descends from them when it fires); None on non-Linux."""
    if not sys.platform.startswith("linux"):
        return None
    ids = [i for i in (_identity(p) for p in processes) if i]
    proc = subprocess.Popen([sys.executable, "-m", "slime.utils.process_reaper", *ids], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return Reaper(proc)


def reap(ids: list[str]) -> list[int]:
    """SIGKILL the still-living processes among `ids` ("pid:create_time") and their descendants; returns pids."""
    victims: dict[int, psutil.Process] = {}
    for ident in ids:
        pid, created = ident.split(":", 1)
        try:
            proc = psutil.Process(int(pid))
            if repr(proc.create_time()) != created:
                continue
            for p in [proc, *proc.children(recursive=True)]:
                victims[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    for p in victims.values():
        try:
            p.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sorted(victims)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's EOF ends the watch
    try:
        while sys.stdin.buffer.read(1 << 16):
            pass
    except OSError:
        pass
    reap(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
