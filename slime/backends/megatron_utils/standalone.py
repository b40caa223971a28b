"""Running the Megatron model outside `train.py` (the checkpoint conversion tools): `init_distributed()` joins
the process group torchrun describes (WORLD_SIZE, RANK, MASTER_ADDR/PORT in the environment), or a one-process
group when run as plain `python`. The tools read their flags with `slime.config.arguments.parse_model_flags`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed() -> None:
    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if cuda else "gloo"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and "MASTER_PORT" not in os.environ:  # plain python: an in-process store, no port to clash
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, rank=int(os.environ.get("RANK", "0")), world_size=world_size)
