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
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29599")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", rank=int(os.environ.get("RANK", "0")),
                            world_size=int(os.environ.get("WORLD_SIZE", "1")))
