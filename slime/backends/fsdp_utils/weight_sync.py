"""Pushing the trainer's weights to rollout engines.

The push walks the model's state dict in bucket-sized groups (HF parameter names: FSDP2 keeps the module's
names). For each group every rank joins the all-gathers of its sharded tensors (`DTensor.full_tensor`,
on the training device); rank 0 casts the full tensors to the engines' dtype (bf16 on CUDA, unchanged on
CPU), sends the bucket through an `EnginePush` (slime/weight_sync/push.py): a CUDA-IPC handle
(CPU shared memory on CPU) to a flattened copy for colocated engines (`update_weights_from_tensor`), a
broadcast over a process group formed with the engines otherwise (`update_weights_from_distributed`),
and drops it once every engine has loaded it. Memory beyond the sharded model: one bucket
(`--update-weight-buffer-size`) plus the tensor being gathered; nothing goes through host memory on CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slime.utils.progress import progress
from slime.weight_sync.push import EnginePush
from slime.weight_sync.tensor_payload import split_into_buckets

logger = logging.getLogger(__name__)


def engine_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a tensor travels in: floating tensors in bf16 when training on CUDA (the engines' dtype),
    everything else as it is."""
    if tensor.is_floating_point() and tensor.device.type == "cuda":
        return torch.bfloat16
    return tensor.dtype


def plan_buckets(state: dict[str, torch.Tensor], buffer_size: int) -> list[list[str]]:
    """Names grouped in state-dict order so each group's full tensors (in their travel dtype) fit the buffer."""
    shapes = [(name, torch.empty(t.shape, dtype=engine_dtype(t), device="meta")) for name, t in state.items()]
    return [[name for name, _ in bucket] for bucket in split_into_buckets(shapes, buffer_size)]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor (all-gather on every rank): the whole tensor, in its travel dtype."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to(engine_dtype(tensor))


def update_weights(
    model: torch.nn.Module, engines: Sequence[Any], weight_version: int | str, buffer_size: int,
    engine_push: Callable[[Sequence[Any]], EnginePush],
) -> int:
    """Collective: every rank gathers bucket by bucket, rank 0 pushes each (through `engine_push(engines)`),
    then a barrier. Returns buckets sent (0 off rank 0)."""
    state = model.state_dict()
    plan = plan_buckets(state, buffer_size)
    push = engine_push(engines) if dist.get_rank() == 0 and engines else None
    sent = 0
    try:
        with progress(len(plan), f"push v{weight_version}", "bucket", enabled=push is not None) as bar:
            for i, names in enumerate(plan):
                with torch.no_grad():
                    bucket = [(name, full_tensor(state[name])) for name in names]
                if push is None:
                    continue
                push.send(bucket, str(weight_version))
                sent += 1
                bar.update(1)
                nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
                logger.info("update_weights v%s: bucket %d/%d (%d tensors, %.1f MiB)", weight_version, i + 1,
                            len(plan), len(bucket), nbytes / 2**20)
                del bucket
    finally:
        del state
        # Other ranks wait here so that no rank starts training while engines are still loading.
        dist.barrier()
    return sent
