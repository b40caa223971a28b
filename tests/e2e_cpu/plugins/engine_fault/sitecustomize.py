"""Test-only fault injection into real hf engine servers (tests/e2e_cpu/test_engine_death.py).

Python imports `sitecustomize` at start-up from the first folder of PYTHONPATH that has one; the test puts this
folder there for the engines it starts, through Ray's runtime_env. In any process other than an hf engine
server (`python -m slime.backends.hf_engine`), or without $SLIME_TEST_ENGINE_FAULT, it does nothing.

$SLIME_TEST_ENGINE_FAULT = MODE:N. After N decode steps every decode step raises the error a GPU out of memory
raises (torch.OutOfMemoryError with CUDA's message), so the engine's own scheduler logs it and fails the running
requests, as it does on a GPU. MODE `raise`: the server keeps running (what our hf engine does after a CUDA OOM).
MODE `die`: the step after the first failure SIGKILLs the server (what the kernel's OOM killer, or SGLang after
its scheduler failed, does).

$SLIME_TEST_ENGINE_FAULT = hold:PATH (tests/e2e_cpu/test_engine_idle.py): while the file PATH exists, every decode step
decodes nothing (it sleeps HOLD_POLL_S and returns), so the running requests stay in the batch, running and not paused,
for as long as the test keeps the file, whatever the machine's load; deleting the file lets them go on. Each held
step returns between two polls, so pausing, aborting and `exclusive()` work as they do between real steps.
"""

import os
import sys

_SPEC = os.environ.get("SLIME_TEST_ENGINE_FAULT")

if _SPEC and "slime.backends.hf_engine" in sys.orig_argv:
    import signal
    import time

    import torch

    from slime.backends.hf_engine import scheduler as _scheduler

    _MODE, _ARG = _SPEC.split(":", 1)
    _decode = _scheduler.Scheduler._decode
    _AFTER = 0 if _MODE == "hold" else int(_ARG)
    _steps = {"decode": 0, "failed": 0}
    HOLD_POLL_S = 0.02

    def _held_decode(self):
        if os.path.exists(_ARG):
            time.sleep(HOLD_POLL_S)
            return None
        return _decode(self)

    def _faulty_decode(self):
        _steps["decode"] += 1
        if _steps["decode"] <= _AFTER:
            return _decode(self)
        if _MODE == "die" and _steps["failed"]:
            os.kill(os.getpid(), signal.SIGKILL)
        _steps["failed"] += 1
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 36.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
            "20.19 GiB is free. Process 81234 has 60.02 GiB memory in use. Including non-PyTorch memory, this "
            "process has 59.53 GiB memory in use.")

    _scheduler.Scheduler._decode = _held_decode if _MODE == "hold" else _faulty_decode
