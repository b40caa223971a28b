"""Pushing the trainer's weights to rollout engines.

Every rank joins a full-state-dict gather (HF parameter names: FSDP2 keeps the module's names); rank 0
splits the tensors into buckets of at most `--update-weight-buffer-size` bytes and sends them bucket by
bucket through an `EnginePush` (slime/backends/weight_broadcast.py): handles to a flattened copy for
colocated engines (`update_weights_from_tensor`), a broadcast over a process group formed with the engines
otherwise (`update_weights_from_distributed`). Each bucket is loaded by every engine before the next.

Simplification: the whole state dict is gathered to rank 0's CPU memory first (bounded by the model size,
not the bucket size), so colocated buckets travel as CPU shared memory (the engine copies them onto its
device) rather than CUDA IPC.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from slime.backends.weight_broadcast import EnginePush
from slime.utils.progress import progress
from slime.utils.weight_transfer import split_into_buckets

logger = logging.getLogger(__name__)


def gather_full_state_dict(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Collective: full, unsharded tensors on rank 0's CPU (HF names, in module order); [] elsewhere."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return list(state.items())


def push_to_engines(named_tensors: list[tuple[str, torch.Tensor]], push: EnginePush, weight_version: str,
                    buffer_size: int) -> int:
    """Send buckets through a begun `push`; returns the number of buckets sent."""
    buckets = split_into_buckets(named_tensors, buffer_size)
    with progress(len(buckets), f"push v{weight_version}", "bucket") as bar:
        for i, bucket in enumerate(buckets):
            push.send(bucket, weight_version)
            bar.update(1)
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            logger.info("update_weights v%s: bucket %d/%d (%d tensors, %.1f MiB)", weight_version, i + 1,
                        len(buckets), len(bucket), nbytes / 2**20)
    return len(buckets)


def update_weights(
    model: torch.nn.Module, engines: Sequence[Any], weight_version: int | str, buffer_size: int,
    engine_push: Callable[[Sequence[Any]], EnginePush],
) -> int:
    """Collective: gather on all ranks, push from rank 0 (through `engine_push(engines)`), barrier. Returns
    buckets sent (0 off rank 0)."""
    named = gather_full_state_dict(model)
    sent = 0
    try:
        if dist.get_rank() == 0 and engines:
            sent = push_to_engines(named, engine_push(engines), str(weight_version), buffer_size)
    finally:
        del named
        # Other ranks wait here so that no rank starts training while engines are still loading.
        dist.barrier()
    return sent
