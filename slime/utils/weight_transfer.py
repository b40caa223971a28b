"""Same-host tensor hand-over for `POST /update_weights_from_tensor`.

A bucket of named tensors is flattened into one contiguous buffer per dtype ("flattened_bucket", the
format SGLang accepts), pickled with torch's multiprocessing reducers and base64-encoded so it fits in
JSON. The pickle carries a handle, not the data: a CUDA IPC handle for GPU tensors, a shared-memory
file name for CPU tensors (the `file_system` sharing strategy, so that an unrelated process such as
an engine server can open it). The sender must keep the buffers alive until the receiver has loaded
them, i.e. until the HTTP call returns.
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing.reductions  # noqa: F401  (registers torch reducers on ForkingPickler)


@dataclass
class FlatEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    numel: int


@dataclass
class FlattenedBucket:
    buffers: dict[str, torch.Tensor]  # dtype name -> 1-D buffer
    entries: list[FlatEntry]

    def unflatten(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for e in self.entries:
            buf = self.buffers[str(e.dtype)]
            out.append((e.name, buf[e.start : e.start + e.numel].view(e.shape)))
        return out


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> FlattenedBucket:
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named_tensors:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    buffers, entries = {}, []
    for dtype, items in by_dtype.items():
        start = 0
        parts = []
        for name, t in items:
            flat = t.detach().contiguous().view(-1)
            entries.append(FlatEntry(name, tuple(t.shape), dtype, start, flat.numel()))
            parts.append(flat)
            start += flat.numel()
        buffers[str(dtype)] = torch.cat(parts)
    return FlattenedBucket(buffers, entries)


def serialize_bucket(bucket: FlattenedBucket) -> str:
    """Handle-pickle a bucket (CPU buffers are moved to shared memory first)."""
    if any(not b.is_cuda for b in bucket.buffers.values()):
        mp.set_sharing_strategy("file_system")
        for b in bucket.buffers.values():
            if not b.is_cuda:
                b.share_memory_()
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(bucket)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_bucket(payload: str) -> FlattenedBucket:
    mp.set_sharing_strategy("file_system")
    bucket = pickle.loads(base64.b64decode(payload))
    if not isinstance(bucket, FlattenedBucket):
        raise TypeError(f"update_weights_from_tensor: expected a FlattenedBucket, got {type(bucket).__name__}")
    return bucket


def split_into_buckets(
    named_tensors: list[tuple[str, torch.Tensor]], max_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most `max_bytes` (a single larger tensor gets its own)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def send_bucket(bucket: list[tuple[str, torch.Tensor]], engines, weight_version: str) -> None:
    """Flatten one bucket, hand every engine a handle to it and wait until all have loaded it.

    Engines are Ray actor handles (called concurrently) or in-process objects (called in turn), each with
    `update_weights_from_tensor(payload, weight_version)`. The flattened buffer stays referenced until
    every engine has answered, because the payload carries a handle, not the data."""
    flat = flatten_bucket(bucket)
    payload = serialize_bucket(flat)
    refs = []
    for engine in engines:
        method = engine.update_weights_from_tensor
        if hasattr(method, "remote"):
            refs.append(method.remote(payload, weight_version))
        else:
            method(payload, weight_version)
    if refs:
        import ray

        ray.get(refs)
    del flat, payload
