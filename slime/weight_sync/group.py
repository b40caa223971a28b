"""The process group behind SGLang's `init_weights_update_group` / `update_weights_from_distributed`.

Both ends use it: the trainer (rank 0, it broadcasts) and an engine server (ranks `rank_offset ..`, one per
engine TP rank, they receive). The group is formed the way SGLang forms it, so a trainer built on this
module can talk to a real SGLang server and the contract tests can drive the `hf` engine the same way:
a TCP rendezvous at `tcp://master_address:master_port` whose store lives with rank 0, and a process
group created *outside* the default group (an engine has no default group; a trainer's default group is
its training world), named `group_name` and registered with torch so `dist.broadcast(..., group=pg)`
works with group-local ranks (rank r of the group is "global" rank r for that call).

Forming the group blocks until all `world_size` ranks have joined, so one side must join from a
background thread (SGLang's HTTP handler waits while its scheduler joins; the trainer calls the engines
first and then joins itself). Broadcasts go tensor by tensor, in the order of the names of the
`update_weights_from_distributed` call, from rank 0.

Simplification: it reaches into torch's private `_new_process_group_helper` (as SGLang does), because
torch's public API only makes groups that are subsets of an existing default group.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

DEFAULT_TIMEOUT_S = 600.0


def open_rendezvous(master_address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's store, listening on a port the OS picks as it binds (`.port`): hand that port to the other ranks,
    then pass the store to `init_weight_update_group` (the training ranks' rendezvous uses it too). A port looked
    up first and bound later could be taken in between."""
    return dist.TCPStore(master_address, 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, backend: str = "nccl",
                             timeout_s: float = DEFAULT_TIMEOUT_S, store: dist.Store | None = None) -> dist.ProcessGroup:
    """Join (rank 0: create) the group; returns once every rank has joined. `store`: rank 0's own, from
    `open_rendezvous` (then `master_address` / `master_port` are its address)."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"weight update group backend {backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    if group_name in c10d._world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} already exists in this process; "
                         "destroy it first or pick another group_name")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        url = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # SGLang (init_custom_process_group) and slime key the group's rendezvous under the group name: without the
    # same prefix the two sides wait for each other's keys until the timeout.
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                           timeout=timeout)
    # Group rank r is rank r for the collectives' src/dst arguments (there is no default group to map into).
    c10d._world.pg_group_ranks[pg] = {r: r for r in range(world_size)}
    return pg


def destroy_weight_update_group(pg: dist.ProcessGroup) -> None:
    dist.destroy_process_group(pg)


def broadcast_tensors(pg: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Rank 0 sends, every other rank receives into `tensors` (in place), one tensor after the other."""
    works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
    for w in works:
        w.wait()
