"""The leak check itself can fail: a run process started from this session is found until it is reaped."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.e2e_cpu.leaks import TAG_VAR, run_processes, wait_for_no_new_processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_leak_check_sees_a_child_until_it_is_reaped():
    before = run_processes()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "train.py"])
    try:
        assert child.pid in wait_for_no_new_processes(before, timeout_s=1.0)
    finally:
        child.kill()
        child.wait()
    assert wait_for_no_new_processes(before, timeout_s=5.0) == {}


def test_the_session_tag_names_the_xdist_worker_and_is_never_inherited():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    assert os.environ[TAG_VAR].split(":")[:2] == [worker, str(os.getpid())]
    # a session started with this session's tag in its environment (another xdist worker, a nested pytest)
    # makes its own
    code = "import os; import tests.e2e_cpu.leaks; print(os.environ[tests.e2e_cpu.leaks.TAG_VAR])"
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw7"}
    child = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    tag = child.stdout.strip()
    assert tag != os.environ[TAG_VAR] and tag.startswith("gw7:")
