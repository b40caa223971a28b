"""Trainer side of the weight push: `push_weights` (the one loop every backend runs), `EnginePush` (the path a
bucket takes) and `BroadcastGroup` (SGLang's broadcast sync).

A backend hands `push_weights` its weights as (HF name, full tensor) pairs, produced lazily (gathering a
tensor may be a collective every rank joins); rank 0 groups them into buckets (slime/weight_sync/buckets.py)
and sends each through its `EnginePush`. `EnginePush(colocate)`: engines that share the training GPUs
(`--colocate`) get handles to the bucket (`update_weights_from_tensor`, CUDA IPC or CPU shared memory:
slime/weight_sync/tensor_payload.py, `send_bucket`); engines elsewhere get it by broadcast (below), which also
works across hosts. The group is formed again when an engine's server changed (a fault-tolerant restart).

Training rank 0 forms a process group with every engine's TP ranks (`init_weights_update_group`: the
trainer is group rank 0, engine i's ranks follow), then per bucket tells every engine which tensors come
(`update_weights_from_distributed`: names, dtypes, shapes, in order) and broadcasts them while the engines
wait. The group is formed once and kept for the run; `close` dissolves it on both ends. NCCL on GPUs,
gloo on CPU. The group mechanics are slime/weight_sync/group.py, shared with the engines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from slime.utils.net import free_port, node_ip
from slime.utils.progress import progress
from slime.weight_sync.buckets import Named, buckets
from slime.weight_sync.group import broadcast_tensors, destroy_weight_update_group, init_weight_update_group
from slime.weight_sync.tensor_payload import flatten_bucket, serialize_bucket

logger = logging.getLogger(__name__)


def _start(calls: list[tuple[Any, str, tuple, dict]]) -> Callable[[], list]:
    """Start engine calls without waiting (Ray actor handles, or plain objects on threads); returns a waiter."""
    refs, futures, pool = [], [], None
    for engine, method, args, kwargs in calls:
        fn = getattr(engine, method)
        if hasattr(fn, "remote"):
            refs.append(fn.remote(*args, **kwargs))
        else:
            pool = pool or ThreadPoolExecutor(max_workers=len(calls))
            futures.append(pool.submit(fn, *args, **kwargs))

    def wait() -> list:
        out = [f.result() for f in futures]
        if pool is not None:
            pool.shutdown()
        if refs:
            import ray

            out += ray.get(refs)
        return out

    return wait


class BroadcastGroup:
    def __init__(self, engines: Sequence[Any], backend: str, group_name: str = "slime_weight_update"):
        self.engines, self.group_name = list(engines), group_name
        self.urls = engine_urls(self.engines)
        infos = _start([(e, "get_server_info", (), {}) for e in self.engines])()
        sizes = [int(info.get("tp_size", 1) or 1) for info in infos]
        world = 1 + sum(sizes)
        address, port = node_ip(), free_port()
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        joined = _start([(e, "init_weights_update_group", (address, port, off, world, group_name, backend), {})
                         for e, off in zip(self.engines, offsets)])
        self.pg = init_weight_update_group(address, port, 0, world, group_name, backend)
        self.device = "cuda" if backend == "nccl" else "cpu"
        joined()
        logger.info("weight broadcast group %r: trainer + %d engine rank(s) over %s", group_name, world - 1, backend)

    def send(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str) -> None:
        names = [n for n, _ in bucket]
        dtypes = [t.dtype for _, t in bucket]
        shapes = [tuple(t.shape) for _, t in bucket]
        done = _start([(e, "update_weights_from_distributed", (names, dtypes, shapes, self.group_name),
                        {"weight_version": weight_version}) for e in self.engines])
        broadcast_tensors(self.pg, [t.to(self.device).contiguous() for _, t in bucket])
        done()

    def close(self) -> None:
        """Dissolve the group on every engine (all are asked even if one fails) and here, whatever they say."""
        try:
            _start([(e, "destroy_weights_update_group", (self.group_name,), {}) for e in self.engines])()
        finally:
            destroy_weight_update_group(self.pg)


def engine_urls(engines: Sequence[Any]) -> list[str]:
    return _start([(e, "get_url", (), {}) for e in engines])()


class EnginePush:
    """Rank 0's route for weight buckets: `begin(engines)` once per push, then `send` every bucket. The
    broadcast group is formed on the first push and kept until an engine's server changes."""

    def __init__(self, colocate: bool):
        self.colocate = colocate
        self._group: BroadcastGroup | None = None
        self._engines: list[Any] = []

    def begin(self, engines: Sequence[Any]) -> None:
        self._engines = list(engines)
        if self.colocate:
            return
        if self._group is not None and engine_urls(self._engines) != self._group.urls:
            # an engine was restarted (--use-fault-tolerance): its new server is not in the group
            logger.warning("engine servers changed since the weight broadcast group was formed; forming it again")
            self.close()
        if self._group is None:
            self._group = BroadcastGroup(self._engines, "nccl" if torch.cuda.is_available() else "gloo")

    def send(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str) -> None:
        if self.colocate:
            send_bucket(bucket, self._engines, weight_version)
        else:
            self._group.send(bucket, weight_version)

    def close(self) -> None:
        """Dissolve the broadcast group, if any; the engines may be gone already, so failures only warn."""
        if self._group is None:
            return
        try:
            self._group.close()
        except Exception as e:  # noqa: BLE001 - teardown goes on
            logger.warning("closing the weight broadcast group: %s", e)
        self._group = None


def send_bucket(bucket: list[Named], engines, weight_version: str) -> None:
    """Flatten one bucket, hand every engine a handle to it and wait until all have loaded it.

    Engines are Ray actor handles or in-process objects (called concurrently, on threads), each with
    `update_weights_from_tensor(payload, weight_version)`; an engine with several TP ranks gives each rank
    its own copy of the payload. The flattened buffer stays referenced until every engine has answered,
    because the payload carries a handle, not the data."""
    flat = flatten_bucket(bucket)
    payload = serialize_bucket(flat)
    _start([(e, "update_weights_from_tensor", (payload, weight_version), {}) for e in engines])()
    del flat, payload


def push_weights(named_tensors: Iterable[Named], route: EnginePush | None, weight_version: int | str,
                 max_bytes: int) -> int:
    """Send a model's weights in buckets of `max_bytes` through `route` (rank 0); a rank without a route only
    consumes `named_tensors` (its tensors take part in the collectives that produce them). Returns the
    buckets sent."""
    if route is None:
        for _ in named_tensors:  # each tensor dropped as soon as it is made: this rank holds no bucket
            pass
        return 0
    sent = 0
    with progress(None, f"push v{weight_version}", "bucket") as bar:
        for bucket in buckets(named_tensors, max_bytes):
            route.send(bucket, str(weight_version))
            sent += 1
            bar.update(1)
            logger.debug("update_weights v%s: bucket %d (%d tensors, %.1f MiB)", weight_version, sent, len(bucket),
                         sum(t.numel() * t.element_size() for _, t in bucket) / 2**20)
    logger.info("update_weights v%s: %d bucket(s) sent", weight_version, sent)
    return sent
