"""Grouping named tensors into the buckets a weight push sends one at a time (`--update-weight-buffer-size`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

DEFAULT_BUFFER_BYTES = 512 * 2**20  # the default of --update-weight-buffer-size

Named = tuple[str, torch.Tensor]


def buckets(named_tensors: Iterable[Named], max_bytes: int) -> Iterator[list[Named]]:
    """Consecutive tensors grouped, in order, into buckets of at most `max_bytes` (a larger tensor gets a bucket
    of its own). Streams: a bucket is handed out before the next tensor is asked for, so a push holds one
    bucket and one tensor, whatever the model's size."""
    current: list[Named] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            yield current
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current:
        yield current
