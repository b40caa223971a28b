"""Milliseconds of a GPU call, for the GPU tests that print how fast a kernel is beside the one it replaces."""

from __future__ import annotations

import torch


def cuda_ms(fn, repeats: int = 20) -> float:
    """Mean milliseconds of `fn()` on the current stream (CUDA events), after one warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats
