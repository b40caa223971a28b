"""Rank processes for multi-process unit tests, forked from multiprocessing's forkserver.

A spawned process imports torch (and megatron-core, slime, the test module) itself, seconds of CPU per rank; a
forked one starts from the forkserver, which imported them once when the session first used it. Each rank is
still a fresh process: the server imports modules and nothing else (no process group, no socket, no thread).
The server is one per pytest process and exits with it. `spawned_result` is the one-process form: a spawned child
(megatron-core's global state and the CPU shim stay in it) whose one result comes back through a queue."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time


def fork_context(*modules: str):
    """The forkserver context, its server told to import torch.distributed and `modules` (the test's own module,
    megatron-core, ...) before forking. The list applies when the server starts: the first test to use it in a
    session sets it, and later tests' ranks import what it lacks themselves."""
    mp.set_forkserver_preload(["torch", "torch.distributed", *modules])
    return mp.get_context("forkserver")


def spawned_result(target, *args, timeout: float = 240):
    """`target(queue, *args)` in a spawned process; what it put on the queue (it must exit 0). Put plain values or
    numpy arrays: a tensor sent through the queue shares memory that is gone once the child exits. The child is not
    a daemon (megatron-core's checkpoint writer starts processes of its own) and is killed on every way out; one
    that dies without a result fails the test at once."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(out, *args))
    proc.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                result = out.get(timeout=1)
                break
            except queue.Empty:
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise AssertionError(f"{target.__name__}: no result (exit code {proc.exitcode}, {timeout} s "
                                         "allowed)") from None
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    return result
