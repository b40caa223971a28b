"""Which of a megatron-core DDP chunk's parameters `--offload-train` moves one by one (slime/backends/training/
offload.py, `loose_parameters`): megatron-core puts the parameters in a contiguous buffer (`param_data`, moved by its
`offload_to_cpu`) only with the distributed optimizer; without it none is in one, and every parameter must move on
its own (else the weights stay on the GPU while the engines generate). Real megatron-core DDP chunks and optimizer,
built by the backend's own `build_model` / `build_optimizer` on the CPU shim (tests/megatron_cpu_shim.py), one gloo
rank in a child process."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def _layout(out, distributed_optimizer: bool) -> None:
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    import torch.distributed as dist

    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_parallel
    from slime.backends.training.offload import TrainState, loose_parameters
    from tests.args import make_args
    from tests.conftest import model_args

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--lr", "1e-3",
                     *(["--use-distributed-optimizer"] if distributed_optimizer else []))
    initialize_parallel(args)
    model = build_model(args)
    build_optimizer(args, model, total_steps=1)  # the distributed optimizer maps the parameters into the buffer
    state = TrainState(ddp_chunks=model)
    loose = {id(p) for p in loose_parameters(state)}
    params = [p for chunk in model for p in chunk.parameters()]
    buffered = [p for chunk in model for b in chunk.buffers if b.param_data is not None for p in b.params]
    out.put({"params": len(params), "loose": len(loose), "in_a_buffer": len(buffered),
             "loose_are_the_unbuffered": loose == {id(p) for p in params} - {id(p) for p in buffered}})
    dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_parameters_outside_a_parameter_buffer_move_one_by_one(distributed_optimizer):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_layout, args=(out, distributed_optimizer), daemon=True)
    proc.start()
    try:
        result = out.get(timeout=240)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    assert result["params"] > 0 and result["loose_are_the_unbuffered"], result
    if distributed_optimizer:  # every parameter is a view of the buffer, which megatron-core moves
        assert result == {**result, "loose": 0, "in_a_buffer": result["params"]}
    else:  # no parameter buffer: all of them move one by one
        assert result == {**result, "loose": result["params"], "in_a_buffer": 0}
    assert proc.exitcode == 0
