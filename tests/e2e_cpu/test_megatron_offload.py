"""Which of a megatron-core DDP chunk's parameters `--offload-train` moves one by one (slime/backends/training/
offload.py, `loose_parameters`): megatron-core puts the parameters in a contiguous buffer (`param_data`, moved by its
`offload_to_cpu`) only with the distributed optimizer; without it none is in one, and every parameter must move on
its own (else the weights stay on the GPU while the engines generate). Real megatron-core DDP chunks and optimizer,
built by the backend's own `build_model` / `build_optimizer` on the CPU shim (tests/megatron_cpu_shim.py), one gloo
rank in a child process. And that a parameter moved one by one keeps training: its storage is freed and refilled in
place (`park_storage`), which keeps the hook megatron-core DDP put on its gradient accumulator; replacing its `.data`
with a tensor of another device (what the offloader did before) drops it, and the optimizer then steps on zeros."""

from __future__ import annotations

import importlib.util
import pytest

from tests.forkserver import spawned_result

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def _layout(out, distributed_optimizer: bool, lora: bool = False) -> None:
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    import torch.distributed as dist

    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_parallel
    from slime.backends.training.offload import TrainState, loose_parameters
    from tests.args import make_args
    from tests.conftest import model_args

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--lr", "1e-3",
                     "--use-distributed-optimizer" if distributed_optimizer else "--no-use-distributed-optimizer",
                     *(["--lora-rank", "4", "--target-modules", "all-linear", "--transformer-impl", "local"]
                       if lora else []))
    initialize_parallel(args)
    model = build_model(args)
    build_optimizer(args, model, total_steps=1)  # the distributed optimizer maps the parameters into the buffer
    state = TrainState(ddp_chunks=model)
    loose = {id(p) for p in loose_parameters(state)}
    params = [p for chunk in model for p in chunk.parameters()]
    buffered = [p for chunk in model for b in chunk.buffers if b.param_data is not None for p in b.params]
    frozen = {id(p) for p in params if not p.requires_grad}
    out.put({"params": len(params), "loose": len(loose), "in_a_buffer": len(buffered), "frozen": len(frozen),
             "loose_are_the_unbuffered": loose == {id(p) for p in params} - {id(p) for p in buffered},
             "loose_are_the_frozen": loose == frozen})
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_lora_models_frozen_base_moves_one_by_one():
    """LoRA (--colocate works with it): megatron-core's DDP gives buffers only to parameters that train, so with the
    distributed optimizer the adapters are in the buffer and the frozen base, in none, moves one by one; there is no
    gradient or optimizer state of the base to move."""
    result = spawned_result(_layout, True, True)  # distributed optimizer, LoRA
    assert result["frozen"] > 0 and result["in_a_buffer"] == result["params"] - result["frozen"], result
    assert result["loose_are_the_frozen"] and result["loose_are_the_unbuffered"], result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_parameters_outside_a_parameter_buffer_move_one_by_one(distributed_optimizer):
    result = spawned_result(_layout, distributed_optimizer)
    assert result["params"] > 0 and result["loose_are_the_unbuffered"], result
    if distributed_optimizer:  # every parameter is a view of the buffer, which megatron-core moves
        assert result == {**result, "loose": 0, "in_a_buffer": result["params"]}
    else:  # no parameter buffer: all of them move one by one
        assert result == {**result, "loose": result["params"], "in_a_buffer": 0}


def _step_after(out, how: str) -> None:
    """One optimizer step of a bf16 chunk (no distributed optimizer: every parameter loose) after its parameters were
    left `untouched`, `parked` (the offloader's round trip: `park_storage` / `unpark_storage`), or `swapped` (what
    the offloader did before: `.data` replaced by a tensor of another type and put back; on the GPU a host tensor,
    another device, here another dtype: autograd treats both alike)."""
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    import torch
    import torch.distributed as dist

    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_parallel
    from slime.backends.training.offload import TrainState, loose_parameters, park_storage, unpark_storage
    from tests.args import make_args
    from tests.conftest import model_args

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--bf16", "--lr", "1e-2",
                     "--weight-decay", "0", "--seed", "0", "--no-use-distributed-optimizer")
    initialize_parallel(args)
    torch.manual_seed(0)
    model = build_model(args)
    optimizer, _ = build_optimizer(args, model, total_steps=1)
    loose = loose_parameters(TrainState(ddp_chunks=model))
    values = [p.detach().clone() for p in loose]
    freed = []
    for p in loose:
        if how == "parked":
            host = park_storage(p)
            freed.append(p.untyped_storage().nbytes() == 0)
            unpark_storage(p, host)
        elif how == "swapped":
            kept = p.data
            p.data = kept.float()
            p.data = kept
    restored = all(torch.equal(p.detach(), v) for p, v in zip(loose, values))
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    g = torch.Generator().manual_seed(1)
    loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in loose)  # the DDP hooks see a backward
    loss.backward()
    with_main_grad = sum(bool(p.main_grad.abs().sum() > 0) for p in loose)
    _, grad_norm, _ = optimizer.step()
    moved = sum(not torch.equal(p.detach(), v) for p, v in zip(loose, values))
    out.put({"params": len(loose), "dtype": str(loose[0].dtype), "freed": all(freed) if freed else None,
             "restored": restored, "with_main_grad": with_main_grad, "grad_norm": float(grad_norm), "moved": moved})
    dist.destroy_process_group()


def _buffer_round_trip(out) -> None:
    """The distributed optimizer's parameter buffer moved twice by `_move` (the offloader's buffer move) and brought
    back by megatron-core's `reload_from_cpu`."""
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    import torch
    import torch.distributed as dist

    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_parallel
    from slime.backends.training.offload import TrainState, _ddp_buffers, _move
    from tests.args import make_args
    from tests.conftest import model_args

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--use-distributed-optimizer")
    initialize_parallel(args)
    model = build_model(args)
    build_optimizer(args, model, total_steps=1)
    state = TrainState(ddp_chunks=model)
    buffers = [b for chunk in model for b in _ddp_buffers(chunk) if b.param_data is not None]
    values = [p.detach().clone() for chunk in model for p in chunk.parameters()]
    hosts, rounds = [], []
    for _ in range(2):
        _move(state, [], "cpu", params=True, grads=False)
        freed = all(b.param_data.untyped_storage().nbytes() == 0 for b in buffers)
        hosts.append([b.param_data_cpu.data_ptr() for b in buffers])
        same_shape = all(b.param_data_cpu.shape == b.param_data.shape and b.param_data_cpu.dtype == b.param_data.dtype
                         for b in buffers)
        for b in buffers:
            b.reload_from_cpu(move_params=True, move_grads=False)
        back = all(torch.equal(p.detach(), v) for p, v in zip((p for c in model for p in c.parameters()), values))
        rounds.append({"freed": freed, "same_shape": same_shape, "back": back})
    out.put({"buffers": len(buffers), "rounds": rounds, "host_kept": hosts[0] == hosts[1]})
    dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_a_parameter_moved_one_by_one_keeps_training():
    """megatron-core DDP adds each gradient into the parameter's `main_grad` from a hook on the parameter's gradient
    accumulator, and the optimizer steps on `main_grad`. The offloader's round trip of a loose parameter (its storage
    freed and refilled, the tensor kept) leaves that hook in place: the step is the step of an untouched chunk.
    Replacing `.data` with a tensor of another type (the offloader did, with a host tensor) makes autograd drop the
    accumulator, and with it the hook: no gradient reaches `main_grad`, the optimizer steps on zeros, the weights
    stay (the GPU failure: Megatron's on-policy distillation under --colocate did not learn)."""
    untouched, parked, swapped = (spawned_result(_step_after, how) for how in ("untouched", "parked", "swapped"))
    print(untouched, parked, swapped, sep="\n")
    n = untouched["params"]
    assert n > 0 and untouched["dtype"] == "torch.bfloat16"
    assert untouched == {**untouched, "with_main_grad": n, "moved": n} and untouched["grad_norm"] > 0
    assert parked == {**untouched, "freed": True, "restored": True}
    assert swapped == {**untouched, "restored": True, "with_main_grad": 0, "grad_norm": 0.0, "moved": 0}


@pytest.mark.timeout(300)
def test_the_parameter_buffers_host_copy_is_made_by_the_offloader_and_kept():
    """megatron-core's first `offload_to_cpu` would copy the parameter buffer to pageable memory and pin a copy of
    that (`.cpu().pin_memory()`, which fails without CUDA): the offloader gives the buffer its host copy first
    (slime/utils/pinned.py), megatron-core copies into it, and the next offload reuses it."""
    result = spawned_result(_buffer_round_trip)
    assert result["buffers"] > 0 and result["host_kept"], result
    assert result["rounds"] == [{"freed": True, "same_shape": True, "back": True}] * 2, result
