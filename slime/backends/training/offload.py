"""Moving a trainer's GPU state to host memory and back (`--offload-train`, docs/colocate.md).

While colocated engines generate, the training ranks hold nothing on the GPU: parameters, gradients, optimizer
state and the frozen copies (reference, teacher) move to host memory, and the caching allocator's reserve is
handed back. Around a push it goes in two moves: first everything but the weights the push reads (optimizer
state, gradients, frozen copies), so that the engines can take their weights back beside the trainer's, then the
weights. The backends say what they hold (`TrainState`); this module moves it:

- whole modules (FSDP2 modules included: `FSDPModule._apply` re-registers the sharded parameters, and DTensor
  parameters are swapped in place, so optimizer references stay valid; tests/unit/test_fsdp_offload_contract.py
  checks that on CPU) with `module.to(device)`;
- megatron-core DDP chunks through their contiguous buffers (`_ParamAndGradBuffer.offload_to_cpu` /
  `reload_from_cpu`: a pinned host copy of the parameters, the gradient storage freed and zeroed on return);
  megatron-core keeps a parameter buffer only with the distributed optimizer, so without it the chunks' parameters
  move one by one, the same way: each one's storage copied to a pinned host tensor and freed (`park_storage`), the
  parameter itself left a tensor of its device. Not by replacing its `.data` with a host tensor: autograd then drops
  the parameter's gradient accumulator (a `.data` of another device or dtype does that), the node megatron-core DDP
  hooked to add each gradient into `main_grad`, and the optimizer steps on zero gradients from then on;
- torch optimizers' parameters (e.g. fp32 master shards) and state tensors into pinned host memory (DTensor state,
  FSDP2's, with `DTensor.to`), each put back on the device it came from (a CPU `step` counter stays on the CPU).
  The pinned host tensors are kept from one offload to the next (pinning tens of GB takes seconds; megatron-core
  keeps its buffers' host copies the same way). They are made by `slime.utils.pinned.pinned_empty`, exact-size and
  paged in by several threads, ~4x faster than torch's pinned allocator, whose blocks are also rounded up to powers
  of two (a 4B model's first offloads took 52 s with it); a DDP chunk's parameter buffer gets its host copy the same
  way before megatron-core's first `offload_to_cpu` (which would copy to pageable memory, then pin a copy of that).

Bringing the state back can leave the optimizer's part in flight (`onload(defer_optimizer=True)`, the Megatron
trainer's): its tensors are allocated at once, their copies are queued on a side stream, and the forward and backward
of the first optimizer step run beside them (nothing there reads optimizer state; a 0.6B model's fp32 main
parameters and Adam moments are ~7 GB, ~0.2 s over PCIe, on an H100). `optimizer_ready()` makes the compute stream
wait for those copies (no host wait); the trainer calls it before the optimizer step and before anything else that
reads the optimizer. DTensor state (FSDP2's) always comes back at once.

Without CUDA there is nothing to move: every call is a no-op that reports 0 bytes.

Each offload ends by handing the memory back to the driver: `torch.cuda.ipc_collect()` (a CUDA tensor shared with
another process, as a weight push shares its buckets with colocated engines, stays allocated in torch's IPC "limbo"
when the sender drops it before the receiver has; only a collect frees it once the receiver let go), then
`torch.cuda.empty_cache()`. `memory_gb` is what the handoff reports after each move (docs/colocate.md).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from slime.utils.pinned import pinned_empty


@dataclass
class TrainState:
    """What one training rank holds on its device."""

    weights: list[torch.nn.Module] = field(default_factory=list)  # what a push reads, moved whole (FSDP policy)
    modules: list[torch.nn.Module] = field(default_factory=list)  # other modules moved whole (frozen copies, critic)
    ddp_chunks: list[Any] = field(default_factory=list)  # megatron-core DDP chunks: gradients, then parameters
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)  # torch optimizers (inner ones)


class Offloader:
    """Offloads one `TrainState` (in one or two moves) and brings it back; `offloaded` says whether any is off."""

    def __init__(self, device: torch.device):
        self.device = device
        self.state_off = False  # optimizer state, gradients, `modules`
        self.weights_off = False  # `weights` and the DDP chunks' parameters
        self._moved: list[tuple[Any, Any, torch.device]] = []  # (container, key, device it came from)
        self._weights_moved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # parameters no buffer holds, parked
        self._host: dict[tuple[int, Any], tuple[Any, torch.Tensor]] = {}  # pinned copies kept across offloads
        self._side: torch.cuda.Stream | None = None  # where deferred optimizer copies run
        self._optimizer_copied: torch.cuda.Event | None = None  # recorded after them; None: nothing in flight

    @property
    def offloaded(self) -> bool:
        return self.state_off or self.weights_off

    def offload(self, state: TrainState, weights: bool = True) -> int:
        """What of `state` is on the device to host memory (`weights=False`: all but the weights a push reads);
        returns the bytes that left the device."""
        if self.device.type != "cuda" or (self.state_off and (self.weights_off or not weights)):
            return 0
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.synchronize(self.device)  # every stream: deferred optimizer copies included
        self._optimizer_copied = None
        if not self.state_off:
            # an optimizer's parameters that are the model's own (no master copies), or views of its storage (the
            # optimizer CPU offload's device-side shards), move with their module/buffer
            own = held_storages(state)
            for opt in state.optimizers:
                opt.zero_grad(set_to_none=True)
                self._offload_optimizer(opt, own)
            _move(state, state.modules, "cpu", params=False, grads=True)
            self.state_off = True
        if weights and not self.weights_off:
            _move(state, state.weights, "cpu", params=True, grads=False)
            for p in loose_parameters(state):
                if p.is_cuda and p.untyped_storage().nbytes() > 0:  # 0: parked with another view of its storage
                    owner, host = self._host.get((id(p), "storage"), (None, None))
                    host = park_storage(p, host if owner is p else None)
                    self._host[(id(p), "storage")] = (p, host)
                    self._weights_moved.append((p, host))
            self.weights_off = True
        torch.cuda.synchronize(self.device)
        torch.cuda.ipc_collect()  # push buckets an engine released after the push returned (module docstring)
        torch.cuda.empty_cache()
        return max(0, before - torch.cuda.memory_allocated(self.device))

    def onload(self, state: TrainState, weights_only: bool = False, defer_optimizer: bool = False) -> int:
        """Everything back on the device, or (`weights_only`) the weights a push reads; returns the bytes that came
        back. `defer_optimizer`: the optimizer's tensors come back on a side stream, ready after `optimizer_ready()`
        (module docstring)."""
        if not self.offloaded or (weights_only and not self.weights_off):
            return 0
        before = torch.cuda.memory_allocated(self.device)
        if weights_only:  # a push between two offloads: the optimizer state and gradients stay in host memory
            _move(state, state.weights, self.device, params=True, grads=False)
            self._weights_back()
            torch.cuda.synchronize(self.device)
            self.weights_off = False
            return max(0, torch.cuda.memory_allocated(self.device) - before)
        # each buffer brings back what is off of it (megatron-core checks); only modules that left move back
        back = [*(state.weights if self.weights_off else []), *(state.modules if self.state_off else [])]
        _move(state, back, self.device, params=True, grads=True)
        self._weights_back()
        deferred = []
        for container, key, device in self._moved:
            host = container.data if key is None else container[key]  # an optimizer's parameter, or a state entry
            if defer_optimizer and not _is_dtensor(host):
                on_device = torch.empty_like(host, device=device)  # allocated on the compute stream, filled beside it
                deferred.append((on_device, host))
            else:
                on_device = host.to(device, non_blocking=True)
            if key is None:
                container.data = on_device
            else:
                container[key] = on_device
        self._moved.clear()
        if deferred:
            self._copy_beside(deferred)
        torch.cuda.current_stream(self.device).synchronize()
        self.state_off = self.weights_off = False
        return max(0, torch.cuda.memory_allocated(self.device) - before)

    def _copy_beside(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each (device tensor, pinned host tensor) pair copied on the side stream; `optimizer_ready` waits for them."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(torch.cuda.current_stream(self.device))  # after the allocations' earlier users
        with torch.cuda.stream(self._side):
            for on_device, host in copies:
                on_device.copy_(host, non_blocking=True)
                on_device.record_stream(self._side)  # not reused while the copy may still write it
        self._optimizer_copied = torch.cuda.Event()
        self._optimizer_copied.record(self._side)

    def optimizer_ready(self) -> None:
        """The compute stream waits for the optimizer copies `onload(defer_optimizer=True)` left in flight (a
        no-op when none are)."""
        if self._optimizer_copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._optimizer_copied)
            self._optimizer_copied = None

    def _weights_back(self) -> None:
        for p, host in self._weights_moved:
            unpark_storage(p, host)
        self._weights_moved.clear()

    def _offload_optimizer(self, opt: torch.optim.Optimizer, own: set[int]) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if isinstance(p, torch.Tensor) and p.is_cuda and not _is_dtensor(p) and _storage(p) not in own:
                    self._moved.append((p, None, p.device))
                    p.data = self._pinned(p, None, p.data)
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    self._moved.append((state, key, value.device))
                    # FSDP2's state is DTensors (sharded like their parameters): moved as DTensors, shard by shard
                    state[key] = value.to("cpu") if _is_dtensor(value) else self._pinned(state, key, value)

    def _pinned(self, container: Any, key: Any, t: torch.Tensor) -> torch.Tensor:
        """`t` copied (asynchronously) into the pinned host tensor kept for `container[key]`."""
        owner, host = self._host.get((id(container), key), (None, None))
        if owner is not container or host.shape != t.shape or host.dtype != t.dtype:
            host = pinned_empty(t.shape, t.dtype)
            self._host[(id(container), key)] = (container, host)
        host.copy_(t, non_blocking=True)
        return host


def _move(state: TrainState, modules: list[torch.nn.Module], device, params: bool, grads: bool) -> None:
    """The DDP chunks' parameter and/or gradient buffers to the host, then `modules` whole, when `device` is "cpu";
    else `modules`, then the buffers, back."""
    out = device == "cpu"
    if not out:
        for module in modules:
            module.to(device)
    for chunk in state.ddp_chunks:
        for buffer in _ddp_buffers(chunk):
            if out:
                if params and buffer.param_data is not None and buffer.param_data_cpu is None:
                    buffer.param_data_cpu = pinned_empty(buffer.param_data.shape, buffer.param_data.dtype)
                buffer.offload_to_cpu(move_params=params, move_grads=grads)
            else:
                buffer.reload_from_cpu(move_params=params, move_grads=grads)
    if out:
        for module in modules:
            module.to(device)


def park_storage(t: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
    """The whole storage of `t` copied (asynchronously) into `host`, a uint8 host tensor of its size (pinned for a CUDA
    `t`; made anew when None or of another size), then freed; returns `host`. `t` stays the same tensor on the same
    device, so whatever holds it (autograd's gradient accumulator and the hooks on it, an optimizer) stays valid; it
    must not be read until `unpark_storage`. Every tensor sharing the storage is parked with it."""
    whole = _storage_bytes(t)
    if host is None or host.numel() != whole.numel():
        size = (whole.numel(),)
        host = pinned_empty(size, torch.uint8) if t.is_cuda else torch.empty(size, dtype=torch.uint8)
    host.copy_(whole, non_blocking=True)
    t.untyped_storage().resize_(0)
    return host


def unpark_storage(t: torch.Tensor, host: torch.Tensor) -> None:
    """`t`'s storage allocated again on its device and filled (asynchronously) from `park_storage`'s `host`."""
    t.untyped_storage().resize_(host.numel())
    _storage_bytes(t).copy_(host, non_blocking=True)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage of `t` (its views' and its own bytes)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def held_storages(state: TrainState) -> set[int]:
    """The device storages the module / buffer moves carry (by data pointer): the modules' parameters and the DDP
    chunks' contiguous parameter and gradient buffers. A tensor on one of them moves with it; moving it again on
    its own would cut it loose from the storage it is a view of."""
    held = {_storage(p) for m in (*state.weights, *state.modules, *state.ddp_chunks) for p in m.parameters()}
    for chunk in state.ddp_chunks:
        for buffer in _ddp_buffers(chunk):
            held.update(_storage(t) for t in (buffer.param_data, buffer.grad_data) if t is not None)
    return held


def _storage(t: torch.Tensor) -> int:
    return (t.to_local() if _is_dtensor(t) else t).untyped_storage().data_ptr()


def loose_parameters(state: TrainState) -> list[torch.nn.Parameter]:
    """The DDP chunks' parameters that no contiguous parameter buffer of theirs holds (`param_data`, a buffer
    megatron-core makes only for the distributed optimizer): each is its own tensor, moved on its own."""
    loose: dict[int, torch.nn.Parameter] = {}
    for chunk in state.ddp_chunks:
        held = {id(p) for buffer in _ddp_buffers(chunk) if buffer.param_data is not None for p in buffer.params}
        loose.update((id(p), p) for p in chunk.parameters() if id(p) not in held)
    return list(loose.values())


def _is_dtensor(t: torch.Tensor) -> bool:
    """FSDP2's parameters (they move with their module, `module.to`) and optimizer state."""
    return type(t).__name__ == "DTensor"


def _ddp_buffers(chunk: Any) -> list[Any]:
    """A megatron-core DDP chunk's contiguous parameter/gradient buffers (its `buffers` list shadows
    nn.Module.buffers)."""
    return list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", []))


def memory_gb(device: torch.device) -> dict[str, float]:
    """`device`'s memory after a move, in GB (empty without CUDA): the caching allocator's `allocated_gb` and
    `reserved_gb`; `device_gb`, used on the device by all processes (the driver's count, `cudaMemGetInfo`); and on
    rank 0 `process_gb`, this process's own as nvidia-smi reports it: the reserve plus what torch does not count
    (the CUDA context, NCCL's buffers, memory torch let go of that the driver still holds). `process_gb` is left out
    when nvidia-smi cannot be run or does not list the process (a PID namespace); it costs one nvidia-smi call."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    figures = {"allocated_gb": torch.cuda.memory_allocated(device) / 1e9,
               "reserved_gb": torch.cuda.memory_reserved(device) / 1e9,
               "device_gb": (total - free) / 1e9}
    if not dist.is_initialized() or dist.get_rank() == 0:  # the handoff reports rank 0's figures only
        used = process_memory_bytes(os.getpid())
        if used is not None:
            figures["process_gb"] = used / 1e9
    return figures


def process_memory_bytes(pid: int) -> int | None:
    """The device memory nvidia-smi reports for process `pid` (all its GPUs); None when nvidia-smi fails or does not
    list it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return used_by_pid(out.stdout, pid) if out.returncode == 0 else None


def used_by_pid(listing: str, pid: int) -> int | None:
    """Bytes of `pid` in nvidia-smi's `--query-compute-apps=pid,used_memory --format=csv,noheader,nounits` listing
    (one `pid, MiB` row per process and GPU; "[N/A]" rows, e.g. under MIG, are skipped); None when it has no row."""
    found = None
    for row in listing.splitlines():
        who, _, mib = (part.strip() for part in row.partition(","))
        if who.isdigit() and int(who) == pid and mib.isdigit():
            found = (found or 0) + int(mib) * 2**20
    return found
