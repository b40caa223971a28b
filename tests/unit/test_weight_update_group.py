"""The trainer's side of the weight broadcast group (slime/weight_sync/group.py) against SGLang's own side.

SGLang's scheduler joins with `sglang.srt.utils.common.init_custom_process_group` (TCP rendezvous, the store
keyed under the group name); the trainer joins with `init_weight_update_group`. Both must find each other's
keys: on the H200 a trainer without SGLang's key prefix waited in gloo's full-mesh connect until its timeout.
Here SGLang's function runs in a second process (gloo on CPU) and must receive what the trainer broadcasts.
"""

from __future__ import annotations

import pytest
import torch

from slime.weight_sync.group import (
    broadcast_tensors,
    destroy_weight_update_group,
    init_weight_update_group,
    open_rendezvous,
)
from tests.forkserver import fork_context

pytest.importorskip("sglang")


def _sglang_rank(port: int, group_name: str, out) -> None:
    import torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group

    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                   group_name=group_name)
    received = torch.zeros(4, 3)
    dist.broadcast(received, src=0, group=pg)
    out.put(received.tolist())
    dist.destroy_process_group(pg)


@pytest.mark.timeout(120)
def test_trainer_group_meets_sglangs_init_custom_process_group():
    store, name = open_rendezvous("127.0.0.1", timeout_s=60), "slime-contract-group"  # the trainer's store, as
    port = store.port  # BroadcastGroup opens it: bound before the engines are told the port
    ctx = fork_context(__name__)  # tests/forkserver.py: a fresh process, torch imported once per session
    out = ctx.Queue()
    peer = ctx.Process(target=_sglang_rank, args=(port, name, out), daemon=True)
    peer.start()
    try:
        pg = init_weight_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=60, store=store)
        sent = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        broadcast_tensors(pg, [sent])
        assert out.get(timeout=60) == sent.tolist()
        destroy_weight_update_group(pg)
        peer.join(30)
        assert peer.exitcode == 0
    finally:
        if peer.is_alive():
            peer.kill()
