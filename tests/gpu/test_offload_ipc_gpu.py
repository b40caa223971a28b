"""An offload hands back a CUDA tensor shared with another process once that process let go of it (GPU).

A colocated weight push shares each bucket with the engines over CUDA IPC. When the sender drops a shared tensor
while a receiver still holds it, torch keeps its block allocated in the IPC "limbo" and frees it only at a later
collect (`torch.cuda.ipc_collect()`, or the next shared tensor's release); `Offloader.offload` collects before it
empties the cache (slime/backends/training/offload.py), so nothing of a push outlives the trainer's offload. A
child process plays the engine: it opens the tensor, holds it past the sender's `del`, then lets go.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from slime.backends.training.offload import Offloader, TrainState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MB = 2**20


def _receiver(queue, opened, sender_dropped, released) -> None:
    t = queue.get()  # rebuilt from the CUDA IPC handle: the sender's memory, opened here
    assert int(t[-1]) == 7
    opened.set()
    sender_dropped.wait(60)
    del t
    torch.cuda.synchronize()
    released.set()


@pytest.mark.timeout(180)
def test_offload_frees_a_shared_tensor_the_receiver_released_after_the_sender_dropped_it():
    device = torch.device("cuda")
    ctx = multiprocessing.get_context("spawn")
    queue, opened, sender_dropped, released = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_receiver, args=(queue, opened, sender_dropped, released), daemon=True)
    proc.start()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base, base_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        bucket = torch.full((256 * MB,), 7, dtype=torch.uint8, device=device)
        queue.put(bucket)
        assert opened.wait(120), "the receiver did not open the shared tensor"
        del bucket  # as send_bucket does after the engines answered; here the receiver still holds it
        in_limbo = torch.cuda.memory_allocated(device) - base
        sender_dropped.set()
        assert released.wait(60), "the receiver did not release the shared tensor"
        Offloader(device).offload(TrainState())  # nothing to move: only the collect and the cache's return
        left = torch.cuda.memory_allocated(device) - base
        print(f"\n[ipc] after the sender's del {in_limbo / MB:.0f} MiB still allocated (limbo); after the receiver "
              f"let go and the offload: {left / MB:.0f} MiB allocated, {torch.cuda.memory_reserved(device) / MB:.0f} "
              "MiB reserved")
        assert in_limbo >= 256 * MB  # the premise: the receiver's hold kept the block allocated
        assert left < MB
        assert torch.cuda.memory_reserved(device) - base_reserved < MB  # and the cache gave its segment back
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
