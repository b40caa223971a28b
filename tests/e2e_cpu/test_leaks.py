"""The leak check itself can fail: a run process started from this session is found until it is reaped."""

from __future__ import annotations

import subprocess
import sys

from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes


def test_leak_check_sees_a_child_until_it_is_reaped():
    before = run_processes()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "train.py"])
    try:
        assert child.pid in wait_for_no_new_processes(before, timeout_s=1.0)
    finally:
        child.kill()
        child.wait()
    assert wait_for_no_new_processes(before, timeout_s=5.0) == {}
