"""The training ranks' rendezvous (slime/backends/training/actor.py): rank 0 binds its store's port when it is
created, so nothing started between then and `init_process_group` (engines, router, outgoing connections) can
take the port. CI once failed a run at start-up with EADDRINUSE when the port was only looked up early."""

from __future__ import annotations

import errno
import socket

import pytest

from slime.backends.training.actor import TrainRayActor
from tests.forkserver import fork_context


def _rank(world_size: int, rank: int, address, out, given: tuple[str, int] | None) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:
        actor = TrainRayActor(world_size, 0, *(given or (None, None)))
        for _ in range(world_size - 1):
            address.put(actor.get_master_addr_and_port())
    else:
        actor = TrainRayActor(world_size, rank, *address.get(timeout=60))
    actor.init_process_group("gloo", timeout_minutes=1)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out.put((rank, t.item()))
    dist.destroy_process_group()


def test_rank_zero_holds_its_port_from_creation(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "")  # the actor sets them; restored after the test
    actor = TrainRayActor(world_size=2, rank=0, master_addr=None, master_port=None)
    addr, port = actor.get_master_addr_and_port()
    assert port > 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(OSError) as e:
            s.bind((addr, port))
    assert e.value.errno == errno.EADDRINUSE


@pytest.mark.timeout(120)
@pytest.mark.parametrize("given", [False, True], ids=["rank0-picks", "rank0-given-address"])
def test_three_ranks_meet_at_rank_zeros_store(given):
    from slime.utils.net import free_port

    ctx = fork_context(__name__)  # tests/forkserver.py: fresh rank processes, torch imported once
    address, out = ctx.Queue(), ctx.Queue()
    rank0 = ("127.0.0.1", free_port()) if given else None  # a launcher that names the address (the test workers)
    procs = [ctx.Process(target=_rank, args=(3, r, address, out, rank0), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=90) for _ in procs)
        assert results == {0: 6.0, 1: 6.0, 2: 6.0}
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def test_free_ports_are_outside_the_ephemeral_range_and_unseeded():
    import random

    from slime.utils.net import PORT_RANGE, _ephemeral_range, free_port

    low, high = _ephemeral_range()
    picks = []
    for _ in range(3):
        random.seed(0)  # a run's seed must not make processes pick the same port
        picks.append(free_port())
    assert all(PORT_RANGE[0] <= p < PORT_RANGE[1] and not low <= p < high for p in picks)
    assert len(set(picks)) > 1
