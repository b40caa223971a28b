"""Milliseconds of a GPU call, for the GPU tests and benchmarks that print how fast a kernel is beside the one it
replaces: back to back (CUDA events), and the GPU kernels' own time (torch.profiler)."""

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


def kernel_seconds(events) -> float:
    """Seconds of GPU kernels among torch.profiler's `events` (`prof.key_averages()`), each kernel counted once."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6


def kernel_ms(fn, repeats: int = 10) -> float:
    """Mean milliseconds of GPU kernels one `fn()` launches, after one warm-up call: what back-to-back timing
    exceeds where the host cannot issue the call's operations as fast as the GPU runs them."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return kernel_seconds(prof.key_averages()) * 1e3 / repeats
