"""Trainer side of the weight push: `push_weights` (the one loop every backend runs), `EnginePush` (the path a
bucket takes) and `BroadcastGroup` (SGLang's broadcast sync).

A backend hands `push_weights` its weights as (HF name, full tensor) pairs, produced lazily (gathering a
tensor may be a collective every rank joins); rank 0 groups them into buckets (slime/weight_sync/buckets.py)
and sends each through its `EnginePush`. `EnginePush(colocated)`: engines that share the training GPUs
(`--colocate`) get handles to the bucket (`update_weights_from_tensor`, CUDA IPC or CPU shared memory:
slime/weight_sync/tensor_payload.py, `send_bucket`); engines elsewhere (without `--colocate`, or past the actor's
GPUs when `--rollout-num-gpus` is above its count) get it by broadcast (below), which also works across hosts.
The group is formed again when an engine's server changed (a fault-tolerant restart).

Training rank 0 forms a process group with every engine's TP ranks (`init_weights_update_group`: the
trainer is group rank 0, engine i's ranks follow), then per bucket tells every engine which tensors come
(`update_weights_from_distributed`: names, dtypes, shapes, in order) and broadcasts them while the engines
wait. The group is formed once and kept for the run; `close` dissolves it on both ends. NCCL on GPUs,
gloo on CPU. The group mechanics are slime/weight_sync/group.py, shared with the engines.

`DiskPush(args)` is slime's disk transport (`--update-weight-transport disk`): every push writes the weights as
an HF safetensors checkpoint under `--update-weight-disk-dir/weight_v{version:06d}` (one shard per bucket, an
index, the model's config files), calls `--custom-update-weight-post-write-path hook(args, version_dir,
rollout_engines)` (slime's hook to publish the files on a filesystem without cross-host read-after-write, e.g.
an object-store mount), then has every engine load the folder (`update_weights_from_disk`) and removes the
previous version's folder (unless `--update-weight-disk-keep-files`). `DeltaPush(args)` is its
`--update-weight-mode delta` (slime/weight_sync/delta.py): after a full first push, only the changed tensors.
Only rank 0 writes, so the hook runs on rank 0 (slime calls it on every rank and
asks it to gate itself). Every route has `begin(engines)`, `send(bucket, version)`, `finish(version)` (after
the last bucket) and `close()`.

Errors: an engine's call that fails raises the engine's own error (a server that died mid-push raises
`EngineDiedError`, whose first line says which engine, how it ended and why: slime/backends/server_engine.py).
When our side of the broadcast fails first (gloo's "Connection closed by peer" as an engine dies), the engines'
answers are awaited for ENGINE_ERROR_WAIT_S and an engine's error is raised in its place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from safetensors.torch import save_file

from slime.utils.hooks import hooks_of
from slime.utils.net import node_ip
from slime.utils.placement import num_colocated_engines
from slime.utils.progress import progress
from slime.weight_sync.buckets import Named, buckets
from slime.weight_sync.delta import MANIFEST, Snapshot, manifest, write_json
from slime.weight_sync.group import (
    broadcast_tensors,
    destroy_weight_update_group,
    init_weight_update_group,
    open_rendezvous,
)
from slime.weight_sync.tensor_payload import flatten_bucket, serialize_bucket

logger = logging.getLogger(__name__)


ENGINE_ERROR_WAIT_S = 30.0  # after our side of a transfer failed: how long the engines' answers are awaited


def _start(calls: list[tuple[Any, str, tuple, dict]]) -> Callable[..., list]:
    """Start engine calls without waiting (Ray actor handles, or plain objects on threads); returns a waiter
    (`wait(timeout=None)`)."""
    refs, futures, pool = [], [], None
    for engine, method, args, kwargs in calls:
        fn = getattr(engine, method)
        if hasattr(fn, "remote"):
            refs.append(fn.remote(*args, **kwargs))
        else:
            pool = pool or ThreadPoolExecutor(max_workers=len(calls))
            futures.append(pool.submit(fn, *args, **kwargs))

    def wait(timeout: float | None = None) -> list:
        out = [f.result(timeout) for f in futures]
        if pool is not None:
            pool.shutdown(wait=timeout is None)
        if refs:
            import ray

            out += ray.get(refs, timeout=timeout)
        return out

    return wait


def _engine_side_error(wait: Callable[..., list], error: BaseException) -> BaseException:
    """Our side of a transfer failed (`error`, e.g. gloo's "Connection closed by peer"): if an engine's own call
    failed too, that is the cause to report (an engine that died says so: `EngineDiedError`, its log's telling
    line), else `error`. The engines' answers are awaited at most ENGINE_ERROR_WAIT_S."""
    try:
        wait(ENGINE_ERROR_WAIT_S)
    except Exception as engine_error:  # noqa: BLE001 - whichever the engine raised is the better report
        if not _is_timeout(engine_error):
            return engine_error
    return error


def _is_timeout(error: BaseException) -> bool:
    return isinstance(error, TimeoutError) or type(error).__name__ == "GetTimeoutError"  # ray's, a TimeoutError too


class BroadcastGroup:
    def __init__(self, engines: Sequence[Any], backend: str, group_name: str = "slime_weight_update"):
        self.engines, self.group_name = list(engines), group_name
        self.urls = engine_urls(self.engines)
        infos = _start([(e, "get_server_info", (), {}) for e in self.engines])()
        sizes = [int(info.get("tp_size", 1) or 1) for info in infos]
        world = 1 + sum(sizes)
        address = node_ip()
        store = open_rendezvous(address)
        port = store.port
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        joined = _start([(e, "init_weights_update_group", (address, port, off, world, group_name, backend), {})
                         for e, off in zip(self.engines, offsets)])
        try:
            self.pg = init_weight_update_group(address, port, 0, world, group_name, backend, store=store)
        except Exception as e:
            cause = _engine_side_error(joined, e)
            if cause is e:
                raise
            raise cause from e
        self.device = "cuda" if backend == "nccl" else "cpu"
        joined()
        logger.info("weight broadcast group %r: trainer + %d engine rank(s) over %s", group_name, world - 1, backend)

    def send(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str) -> None:
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]  # names: the engine actor needs no torch
        shapes = [tuple(t.shape) for _, t in bucket]
        done = _start([(e, "update_weights_from_distributed", (names, dtypes, shapes, self.group_name),
                        {"weight_version": weight_version}) for e in self.engines])
        try:
            broadcast_tensors(self.pg, [t.to(self.device).contiguous() for _, t in bucket])
        except Exception as e:
            cause = _engine_side_error(done, e)
            if cause is e:
                raise
            raise cause from e
        done()

    def close(self) -> None:
        """Dissolve the group on every engine (all are asked even if one fails) and here, whatever they say."""
        try:
            _start([(e, "destroy_weights_update_group", (self.group_name,), {}) for e in self.engines])()
        finally:
            destroy_weight_update_group(self.pg)


def engine_urls(engines: Sequence[Any]) -> list[str]:
    return _start([(e, "get_url", (), {}) for e in engines])()


def engine_weight_versions(engines: Sequence[Any]) -> list[str]:
    """The weight version each engine reports (that of its last loaded push; a new server's initial one)."""
    return [str(v) for v in _start([(e, "get_weight_version", (), {}) for e in engines])()]


class EnginePush:
    """Rank 0's route for weight buckets: `begin(engines)` once per push, then `send` every bucket. The first
    `colocated` engines (those on the training ranks' devices, `--colocate`) get handles; the others get each
    bucket by broadcast, through a group formed on the first push and kept until an engine's server changes."""

    def __init__(self, colocated: int | None = None):
        self.colocated = colocated  # how many of the engines take handles; None: all of them
        self._group: BroadcastGroup | None = None
        self._engines: list[Any] = []
        self._broadcast: list[Any] = []

    def begin(self, engines: Sequence[Any]) -> None:
        engines = list(engines)
        cut = len(engines) if self.colocated is None else self.colocated
        self._engines, self._broadcast = engines[:cut], engines[cut:]
        if not self._broadcast:
            return
        if self._group is not None and engine_urls(self._broadcast) != self._group.urls:
            # an engine was restarted (--use-fault-tolerance): its new server is not in the group
            logger.warning("engine servers changed since the weight broadcast group was formed; forming it again")
            self.close()
        if self._group is None:
            self._group = BroadcastGroup(self._broadcast, "nccl" if torch.cuda.is_available() else "gloo")

    def send(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str) -> None:
        if self._engines:
            send_bucket(bucket, self._engines, weight_version)
        if self._broadcast:
            self._group.send(bucket, weight_version)

    def needs_every_tensor(self) -> bool:
        """False: the engines keep the tensors a push leaves out (slime/weight_sync/frozen.py)."""
        return False

    def finish(self, weight_version: str) -> None:
        """Nothing left to do: every bucket was loaded when it was sent."""

    def close(self) -> None:
        """Dissolve the broadcast group, if any; the engines may be gone already, so failures only warn."""
        if self._group is None:
            return
        try:
            self._group.close()
        except Exception as e:  # noqa: BLE001 - teardown goes on
            logger.warning("closing the weight broadcast group: %s", e)
        self._group = None


_CONFIG_FILES = ("config.json", "generation_config.json")


class DiskPush:
    """Rank 0's route for `--update-weight-transport disk` (the module docstring)."""

    def __init__(self, args: Any):
        self.args = args
        self.root = args.update_weight_disk_dir
        self.post_write = hooks_of(args).custom_update_weight_post_write
        self._engines: list[Any] = []
        self._dir: str | None = None
        self._files: dict[str, str] = {}
        self._previous: str | None = None

    def needs_every_tensor(self) -> bool:
        """True: each version folder is a whole checkpoint the engines load (and the post-write hook publishes)."""
        return True

    def version_dir(self, weight_version: str) -> str:
        return os.path.join(self.root, f"weight_v{int(weight_version):06d}")

    def begin(self, engines: Sequence[Any]) -> None:
        self._engines = list(engines)
        self._dir, self._files = None, {}

    def send(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str) -> None:
        # copies on the CPU: tensors that share storage (tied embeddings) cannot go into one file as views
        self.write_shard({n: t.detach().to("cpu", copy=True).contiguous() for n, t in bucket}, weight_version)

    def open_dir(self, weight_version: str) -> str:
        """This push's folder, made empty on first use (a half-written folder of an interrupted run goes)."""
        if self._dir is None:
            self._dir = self.version_dir(weight_version)
            shutil.rmtree(self._dir, ignore_errors=True)
            os.makedirs(self._dir)
        return self._dir

    def write_shard(self, tensors: dict[str, torch.Tensor], weight_version: str) -> str:
        """Save CPU `tensors` as the push's next `model-NNNNN.safetensors`; returns the file name."""
        name = f"model-{len(set(self._files.values())) + 1:05d}.safetensors"
        save_file(tensors, os.path.join(self.open_dir(weight_version), name), metadata={"format": "pt"})
        self._files.update({n: name for n in tensors})
        return name

    def write_index(self) -> None:
        """The HF index of the shards written, and the model's config files: the folder is a loadable checkpoint."""
        with open(os.path.join(self._dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": self._files}, f)
        for config in _CONFIG_FILES:
            source = os.path.join(self.args.hf_checkpoint, config)
            if os.path.isfile(source):
                shutil.copy(source, self._dir)

    def finish(self, weight_version: str) -> None:
        if self._dir is None:
            raise RuntimeError(f"update_weights v{weight_version}: no bucket was written; nothing for the engines "
                               "to load")
        self.write_index()
        self.publish_and_load(weight_version, "update_weights_from_disk", (self._dir, str(weight_version)))

    def publish_and_load(self, weight_version: str, method: str, call_args: tuple) -> None:
        """Run the post-write hook on the finished folder, have every engine call `method(*call_args)`, then
        remove the previous push's folder (unless --update-weight-disk-keep-files)."""
        if self.post_write is not None:
            self.post_write(self.args, self._dir, self._engines)
        _start([(e, method, call_args, {}) for e in self._engines])()
        if self._previous and self._previous != self._dir and not self.args.update_weight_disk_keep_files:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = self._dir

    def close(self) -> None:
        """The last version's folder stays: the engines hold what it holds."""


class DeltaPush(DiskPush):
    """Rank 0's route for `--update-weight-mode delta` (slime/weight_sync/delta.py): a full checkpoint first (and
    again after a failed push or when an engine's server changed), then only the changed tensors, encoded. Each
    engine applies the folder to its host's `--update-weight-local-checkpoint-dir` and loads that
    (`apply_weight_delta`)."""

    def __init__(self, args: Any):
        super().__init__(args)
        self.snapshot = Snapshot(args.update_weight_delta_encoding, args.update_weight_delta_checksum)
        self._urls: list[str] | None = None
        self._base_id: str | None = None
        self._entries: dict[str, dict] = {}
        self._full = True
        self._total = 0
        self._unfinished = False

    def begin(self, engines: Sequence[Any]) -> None:
        super().begin(engines)
        urls = engine_urls(self._engines)
        if self._urls is not None and urls != self._urls:
            logger.warning("engine servers changed since the last weight push; sending the full weights again")
            self.snapshot.clear()
        if self._unfinished:  # the last push stopped between buckets: the base holds some of its tensors
            self.snapshot.clear()
        self._urls, self._full = urls, not self.snapshot.base
        self._entries, self._total, self._unfinished = {}, 0, True

    def needs_every_tensor(self) -> bool:
        """A full push writes the whole checkpoint the engines' local copies start from; a delta only the changes
        (a tensor left out is one that did not change)."""
        return self._full

    def send(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str) -> None:
        self._total += sum(t.numel() * t.element_size() for _, t in bucket)
        if self._full:
            tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in bucket}
            entries = self.snapshot.record(tensors)
        else:
            tensors, entries = self.snapshot.diff(bucket)
            if not tensors:
                return
        name = self.write_shard(tensors, weight_version)
        self._entries.update({n: {**e, "file": name} for n, e in entries.items()})

    def finish(self, weight_version: str) -> None:
        folder = self.open_dir(weight_version)
        if self._full:
            self.write_index()
        kind = "full" if self._full else "delta"
        m = manifest(kind, weight_version, self._base_id, self.snapshot.encoding, self.snapshot.algorithm,
                     self._entries, self._total)
        write_json(os.path.join(folder, MANIFEST), m)
        try:
            self.publish_and_load(weight_version, "apply_weight_delta",
                                  (folder, self.args.update_weight_local_checkpoint_dir, str(weight_version)))
        except BaseException:
            self.snapshot.clear()  # the engines may hold either version: the next push is a full one
            self._base_id = None
            raise
        self._base_id, self._unfinished = m["push_id"], False
        written = sum(os.path.getsize(os.path.join(folder, f)) for f in set(self._files.values()))
        logger.info("update_weights v%s (%s, %s): %d tensor(s), %.2f MiB written of %.2f MiB", weight_version, kind,
                    self.snapshot.encoding, len(self._entries), written / 2**20, self._total / 2**20)


def weight_route(args: Any) -> EnginePush | DiskPush:
    """Rank 0's route for `args`: the disk transport (full checkpoints, or deltas with --update-weight-mode
    delta), else handles (`--colocate`) or broadcast."""
    if args.update_weight_transport == "disk":
        return DeltaPush(args) if args.update_weight_mode == "delta" else DiskPush(args)
    return EnginePush(num_colocated_engines(args))


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
    sent = nbytes = 0
    with progress(None, f"push v{weight_version}", "bucket") as bar:
        for bucket in buckets(named_tensors, max_bytes):
            route.send(bucket, str(weight_version))
            sent += 1
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            bar.update(1)
            logger.debug("update_weights v%s: bucket %d (%d tensors, %.1f MiB)", weight_version, sent, len(bucket),
                         sum(t.numel() * t.element_size() for _, t in bucket) / 2**20)
    route.finish(str(weight_version))
    logger.info("update_weights v%s: %d bucket(s) sent, %.2f MiB", weight_version, sent, nbytes / 2**20)
    return sent
