"""The distributed optimizer, on by default as in slime, and checkpoints saved without it (this repo's default
before 2026-12-07): megatron-core saves the two optimizers' state under different keys and cannot load one into the
other (slime/backends/megatron_utils/checkpoint.py `_check_optimizer_layout`). Real megatron-core on the CPU shim,
one gloo rank in a child process: each layout resumes its own checkpoint, and the other layout's is refused with the
flag that resumes it."""

from __future__ import annotations

import importlib.util

import pytest

from tests.forkserver import spawned_result

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def cross_loads(out, root: str) -> None:
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    import os

    import torch.distributed as dist

    from slime.backends.megatron_utils import checkpoint
    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_parallel
    from slime.utils.net import free_port
    from tests.args import make_args
    from tests.conftest import model_args

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    layouts = {"distributed": [], "whole": ["--no-use-distributed-optimizer"]}
    args = {name: make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--bf16", *flags)
            for name, flags in layouts.items()}
    initialize_parallel(args["distributed"])
    result = {"default": args["distributed"].use_distributed_optimizer}
    for saved in layouts:
        model = build_model(args[saved])
        optimizer = build_optimizer(args[saved], model, total_steps=2)[0]
        for chunk in model:
            chunk.zero_grad_buffer()
        sum(p.float().sum() for p in model[0].parameters()).backward()
        optimizer.step()
        checkpoint.save(os.path.join(root, saved), 0, model, optimizer)
        ckpt = checkpoint.find_checkpoint(os.path.join(root, saved))
        for running in layouts:
            resumed = build_model(args[running])
            resumed_optimizer = build_optimizer(args[running], resumed, total_steps=2)[0]
            checkpoint.load_model(ckpt, resumed)
            try:
                checkpoint.load_optimizer(ckpt, resumed, resumed_optimizer)
                result[f"{saved} into {running}"] = "loaded"
            except ValueError as e:
                result[f"{saved} into {running}"] = str(e)
    out.put(result)
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_each_optimizer_layout_resumes_its_own_and_the_other_is_refused_with_the_fix(tmp_path):
    result = spawned_result(cross_loads, str(tmp_path))
    assert result["default"] is True, result
    assert result["distributed into distributed"] == result["whole into whole"] == "loaded", result
    whole = result["whole into distributed"]
    assert "saved without the distributed optimizer" in whole and "Pass --no-use-distributed-optimizer" in whole
    assert "--no-load-optim" in whole, whole
    distributed = result["distributed into whole"]
    assert "saved with the distributed optimizer" in distributed and "Pass --use-distributed-optimizer" in distributed
