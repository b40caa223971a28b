"""Pinned (page-locked) host tensors of their exact size, made fast.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator: `cudaHostAlloc`, which pages the
memory in on one thread, and blocks rounded up to a power of two (a 100 MiB tensor takes 128 MiB of host memory).
For buffers made once and kept for the whole run, as the trainer's offload keeps its host copies of the optimizer
state and the weights, `pinned_empty` takes a plain host tensor of the exact size, has its pages written by a few
threads at once (the kernel zeroes each page on its first write: the slow part), then page-locks it with
`cudaHostRegister`; a finalizer unregisters it when the tensor is collected. The tensor must stay the one holder of
its memory (keep it, not only views of it).

benchmarks/pinned_alloc.py measures both ways: on an H100 host, 8 GB as 100 MiB tensors took 4.39 s and 10.2 GB of
host memory with torch's allocator, 1.18 s and 7.97 GB here (8 threads). Without CUDA there is nothing to pin: the
tensor is a plain one.
"""

from __future__ import annotations

import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
THREADS = 8  # 16 measured no faster than 8 (benchmarks/pinned_alloc.py)
PER_THREAD = 8 * 2**20  # the least a thread is started for: a small tensor's pages are written where it is made


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, threads: int = THREADS) -> torch.Tensor:
    """An uninitialised host tensor of `shape` and `dtype`, pinned when CUDA is available (`threads` write its
    pages first; 0: the driver pages it in while registering)."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    touch_pages(t, threads)
    if torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0))
        weakref.finalize(t, _unregister, t.data_ptr()).atexit = False  # the process's exit frees it all
    return t


def touch_pages(t: torch.Tensor, threads: int) -> None:
    """One byte of every page of `t`'s memory written, the pages split among up to `threads` threads of at least
    `PER_THREAD` bytes each (none: 0)."""
    flat = t.view(-1).view(torch.uint8)
    if threads <= 0:
        return
    threads = max(1, min(threads, flat.numel() // PER_THREAD))
    span = -(-flat.numel() // threads // PAGE) * PAGE  # each thread's share, whole pages
    starts = range(0, flat.numel(), span)
    if len(starts) == 1:
        flat[::PAGE].zero_()
        return
    with ThreadPoolExecutor(len(starts)) as pool:  # torch releases the GIL in zero_
        list(pool.map(lambda s: flat[s:s + span:PAGE].zero_(), starts))


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
