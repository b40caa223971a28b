"""slime/utils/process_reaper.py: a SIGKILLed driver leaves no Ray process behind (real Ray, no mocks).

Without the reaper, Ray's `ray::DashboardAgent` and `ray::RuntimeEnvAgent` outlive a SIGKILLed driver by
~60 s (they block reporting the raylet's death to the dead GCS); benchmarks/driver_kill_trials.py found it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from slime.utils import process_reaper  # noqa: E402

DRIVER = """
import time
import ray
ray.init(num_cpus=1, include_dashboard=False)
from slime.utils import process_reaper
reaper = process_reaper.watch(process_reaper.ray_node_processes())  # what slime.ray.launcher.Run does
print("up", flush=True)
time.sleep(600)
"""


def _alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _titles(procs) -> list[str]:
    """Each live process's title (argv[0]); one that ended meanwhile is left out."""
    out = []
    for p in procs:
        try:
            cmdline = p.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if cmdline:
            out.append(cmdline[0])
    return out


def _wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


@pytest.mark.timeout(150)  # ray.init, up to 60 s for the agents' titles, up to 15 s for them to go
def test_sigkilled_driver_leaves_no_ray_agents():
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_ADDRESS="")
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    ray_pids = []
    try:
        assert driver.stdout.readline().strip() == "up"
        # the agents take their titles only after heavy imports (seconds on a loaded machine): wait for both
        deadline = time.monotonic() + 60
        while True:
            procs = psutil.Process(driver.pid).children(recursive=True)
            ray_pids = [p.pid for p in procs]
            titles = " ".join(_titles(procs))
            if ("ray::DashboardAgent" in titles and "ray::RuntimeEnvAgent" in titles) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "ray::DashboardAgent" in titles and "ray::RuntimeEnvAgent" in titles, titles
    finally:
        driver.kill()
        driver.wait()
    left = _wait_gone(ray_pids, timeout=15)
    for pid in left:  # do not leave them to the next test either
        psutil.Process(pid).kill()
    assert left == [], f"outlived the SIGKILLed driver: {left}"


@pytest.mark.timeout(30)
def test_release_reaps_survivors_and_their_children_but_never_a_reused_pid():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                               "time.sleep(60)"])  # fmt: skip
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = psutil.Process(parent.pid).children()[0].pid
        # the bystander is listed with another start time: the pid "was reused", so it must be spared
        assert process_reaper.reap([f"{bystander.pid}:{psutil.Process(bystander.pid).create_time() - 5.0!r}"]) == []
        reaper = process_reaper.watch([psutil.Process(parent.pid)])
        time.sleep(0.5)
        assert _alive([parent.pid, child]) == [parent.pid, child]  # nothing happens while the pipe is open
        reaper.release()
        assert _wait_gone([parent.pid, child], timeout=10) == []
        assert _alive([bystander.pid]) == [bystander.pid]
    finally:
        for p in (parent, bystander):
            p.kill()
            p.wait()
