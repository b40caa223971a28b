"""Moving a trainer's GPU state to host memory and back (`--offload-train`, docs/colocate.md).

While colocated engines generate, the training ranks hold nothing on the GPU: parameters, gradients, optimizer
state and the frozen copies (reference, teacher) move to host memory, and the caching allocator's reserve is
handed back. The backends say what they hold (`TrainState`); this module moves it:

- whole modules (FSDP2 modules included: `FSDPModule._apply` re-registers the sharded parameters, and DTensor
  parameters are swapped in place, so optimizer references stay valid) with `module.to(device)`;
- megatron-core DDP chunks through their contiguous buffers (`_ParamAndGradBuffer.offload_to_cpu` /
  `reload_from_cpu`: a pinned host copy of the parameters, the gradient storage freed and zeroed on return);
- torch optimizers' parameters (e.g. fp32 master shards) and state tensors into pinned host memory (DTensor state,
  FSDP2's, with `DTensor.to`), each put back on the device it came from (a CPU `step` counter stays on the CPU).

Without CUDA there is nothing to move: every call is a no-op that reports 0 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainState:
    """What one training rank holds on its device."""

    modules: list[torch.nn.Module] = field(default_factory=list)  # moved whole (policy under FSDP, frozen copies)
    ddp_chunks: list[Any] = field(default_factory=list)  # megatron-core DDP model chunks (their buffers move)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)  # torch optimizers (inner ones)


class Offloader:
    """Offloads one `TrainState` and brings it back; `offloaded` says where it is now."""

    def __init__(self, device: torch.device):
        self.device = device
        self.offloaded = False
        self._moved: list[tuple[Any, Any, torch.device]] = []  # (container, key, device it came from)

    def offload(self, state: TrainState) -> int:
        """Everything of `state` to host memory; returns the bytes that left the device."""
        if self.offloaded or self.device.type != "cuda":
            return 0
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.synchronize(self.device)
        for opt in state.optimizers:
            opt.zero_grad(set_to_none=True)
            self._offload_optimizer(opt)
        for chunk in state.ddp_chunks:
            for buffer in _ddp_buffers(chunk):
                buffer.offload_to_cpu(move_params=True, move_grads=True)
        for module in state.modules:
            module.to("cpu")
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.offloaded = True
        return max(0, before - torch.cuda.memory_allocated(self.device))

    def onload(self, state: TrainState) -> int:
        """Everything back on the device; returns the bytes that came back."""
        if not self.offloaded:
            return 0
        before = torch.cuda.memory_allocated(self.device)
        for module in state.modules:
            module.to(self.device)
        for chunk in state.ddp_chunks:
            for buffer in _ddp_buffers(chunk):
                buffer.reload_from_cpu(move_params=True, move_grads=True)
        for container, key, device in self._moved:
            if key is None:  # an optimizer's parameter: its .data moves
                container.data = container.data.to(device, non_blocking=True)
            else:  # an entry of an optimizer's state
                container[key] = container[key].to(device, non_blocking=True)
        self._moved.clear()
        torch.cuda.synchronize(self.device)
        self.offloaded = False
        return max(0, torch.cuda.memory_allocated(self.device) - before)

    def _offload_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if isinstance(p, torch.Tensor) and p.is_cuda and not _is_dtensor(p):
                    self._moved.append((p, None, p.device))
                    p.data = _to_pinned(p.data)
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    self._moved.append((state, key, value.device))
                    # FSDP2's state is DTensors (sharded like their parameters): moved as DTensors, shard by shard
                    state[key] = value.to("cpu") if _is_dtensor(value) else _to_pinned(value)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t)
    return host


def _is_dtensor(t: torch.Tensor) -> bool:
    """FSDP2's parameters (they move with their module, `module.to`) and optimizer state."""
    return type(t).__name__ == "DTensor"


def _ddp_buffers(chunk: Any) -> list[Any]:
    """A megatron-core DDP chunk's contiguous parameter/gradient buffers (its `buffers` list shadows
    nn.Module.buffers)."""
    return list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", []))


def memory_gb(device: torch.device) -> dict[str, float]:
    """The caching allocator's view of `device` (allocated and reserved GB); empty without CUDA."""
    if device.type != "cuda":
        return {}
    return {"allocated_gb": torch.cuda.memory_allocated(device) / 1e9,
            "reserved_gb": torch.cuda.memory_reserved(device) / 1e9}
