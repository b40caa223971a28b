"""slime/utils/pinned.py on a real GPU (skipped without CUDA): `pinned_empty`'s tensors are page-locked, take
their exact size of host memory (torch's pinned allocator rounds each block up to a power of two), carry
asynchronous copies both ways, and give their memory back when collected."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from slime.utils.pinned import pinned_empty

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MB = 2**20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_pinned_empty_is_pinned_exact_and_copies_asynchronously():
    torch.empty(1, device="cuda")  # the CUDA context first: its own host memory is not the tensor's
    before = _resident_bytes()
    host = pinned_empty((300 * MB // 4,), torch.float32)  # 300 MiB: torch's allocator would take 512
    grown = _resident_bytes() - before
    assert host.is_pinned()
    assert 0.95 * 300 * MB <= grown <= 1.1 * 300 * MB, grown / MB

    source = torch.randn(host.shape, device="cuda")
    host.copy_(source, non_blocking=True)  # device to host, queued
    back = torch.empty_like(source)
    back.copy_(host, non_blocking=True)  # host to device, after it on the same stream
    torch.cuda.synchronize()
    assert torch.equal(back, source)


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def test_collected_pinned_tensors_give_their_memory_back():
    """Each is unregistered before its memory is freed: pages still registered with the driver would stay locked
    after the free (16 x 512 MiB here)."""
    torch.empty(1, device="cuda")
    before = _available_bytes()
    for _ in range(16):
        host = pinned_empty((512 * MB,), torch.uint8)
        assert host.is_pinned()
        del host
        gc.collect()
    lost = before - _available_bytes()
    assert lost < 2 * 2**30, lost / 2**30
