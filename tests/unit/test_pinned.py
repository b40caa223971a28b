"""slime/utils/pinned.py on CPU: the page-touching that makes `pinned_empty` fast (pinning itself needs CUDA:
tests/gpu/test_pinned_gpu.py)."""

from __future__ import annotations

import psutil
import torch

from slime.utils.pinned import pinned_empty, touch_pages

MB = 2**20


def _resident_bytes() -> int:
    return psutil.Process().memory_info().rss


def test_touch_pages_makes_every_page_resident():
    for threads in (1, 3):
        t = torch.empty(64 * MB, dtype=torch.uint8)  # a fresh mapping: none of it resident yet
        before = _resident_bytes()
        touch_pages(t, threads)
        assert _resident_bytes() - before >= 0.95 * t.numel(), threads
        del t


def test_no_threads_leaves_the_pages_to_the_first_writer():
    t = torch.empty(64 * MB, dtype=torch.uint8)
    before = _resident_bytes()
    touch_pages(t, 0)
    assert _resident_bytes() - before < 0.5 * t.numel()


def test_pinned_empty_has_the_shape_and_dtype_asked_for():
    for shape, dtype in (((3, 5000, 7), torch.float32), ((10,), torch.bfloat16), ((0, 4), torch.int64)):
        t = pinned_empty(shape, dtype, threads=2)
        assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
        t.fill_(1)
        assert int(t.sum()) == t.numel()
