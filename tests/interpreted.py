"""Tests of Triton kernels on CPU: Triton's interpreter runs them when `TRITON_INTERPRET=1` is set before the kernels
are defined (at import), so each such test calls its checks in a Python process of its own."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO_ROOT


def run_interpreted(code: str) -> None:
    """Run `code` (Python source importing the test module's checks) under Triton's interpreter; fails with the
    process's output when it does."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
