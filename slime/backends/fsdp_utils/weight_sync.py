"""Pushing the fsdp trainer's weights to rollout engines.

Every rank walks the model's state dict (HF parameter names: FSDP2 keeps the module's names) and joins the
all-gather of each sharded tensor (`DTensor.full_tensor`, on the training device); rank 0 casts the full tensors
to the engines' dtype (bf16 on CUDA, unchanged on CPU), names them as the model's checkpoint does
(checkpoint_format.py: what SGLang loads) and sends them, bucket by bucket, through its route
(slime/weight_sync/push.py `weight_route`, `push_weights`). Memory beyond the sharded model: one bucket
(`--update-weight-buffer-size`) and the tensor being gathered on rank 0, one tensor on the others; nothing goes
through host memory on CUDA. Parameters that do not train (`--freeze-params-name-list`, e.g. a frozen vision
tower) go in the run's first push only, unless the engines would lose them (slime/weight_sync/frozen.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slime.backends.fsdp_utils.checkpoint_format import CheckpointFormat
from slime.utils.lora_adapter import is_adapter_name
from slime.weight_sync.frozen import FrozenPushes, frozen_parameter_names
from slime.weight_sync.adapter import push_adapter
from slime.weight_sync.push import DiskPush, EnginePush, push_weights


def engine_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a tensor travels in: floating tensors in bf16 when training on CUDA (the engines' dtype),
    everything else as it is."""
    if tensor.is_floating_point() and tensor.device.type == "cuda":
        return torch.bfloat16
    return tensor.dtype


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor (all-gather on every rank): the whole tensor, in its travel dtype."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to(engine_dtype(tensor))


def full_state(model: torch.nn.Module, left_out: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every state-dict entry not in `left_out`, gathered one at a time (every rank must
    iterate it all, with the same `left_out`)."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name not in left_out:
                yield name, full_tensor(tensor)


def frozen_pushes(model: torch.nn.Module, engines_release: bool) -> FrozenPushes:
    """The policy's parameters that never change, by state-dict name (a tied parameter under each of its names)."""
    return FrozenPushes(frozen_parameter_names(model.named_parameters(remove_duplicate=False)), engines_release)


def update_weights(
    model: torch.nn.Module, engines: Sequence[Any], weight_version: int | str, buffer_size: int,
    engine_push: Callable[[Sequence[Any]], EnginePush | DiskPush], frozen: FrozenPushes, names: CheckpointFormat,
) -> int:
    """Collective: every rank gathers, rank 0 pushes (through `engine_push(engines)`) under the checkpoint's
    names (`names`), then a barrier. `frozen` says which tensors this push may leave out
    (slime/weight_sync/frozen.py). Returns buckets sent (0 off rank 0)."""
    route = engine_push(engines) if dist.get_rank() == 0 and engines else None
    try:
        state = names.convert(full_state(model, frozen.left_out(route, engines)))
        sent = push_weights(state, route, weight_version, buffer_size)
        frozen.pushed(weight_version)
        return sent
    finally:
        # Other ranks wait here so that no rank starts training while engines are still loading.
        dist.barrier()


def update_adapter(model: torch.nn.Module, engines: Sequence[Any], weight_version: int | str, config: dict) -> int:
    """Collective, with LoRA: every rank gathers the adapter tensors only (the base is frozen: the engines keep
    theirs), rank 0 loads them into every engine as one adapter (`push_adapter`), then a barrier. Returns the bytes
    sent per engine (0 off rank 0)."""
    with torch.no_grad():
        named = [(name, full_tensor(t)) for name, t in model.state_dict().items() if is_adapter_name(name)]
    try:
        if dist.get_rank() == 0 and engines:
            return push_adapter(named, engines, config, str(weight_version))
        return 0
    finally:
        dist.barrier()
