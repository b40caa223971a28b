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


def resumes_megatron_lm_format(out, root: str) -> None:
    """A checkpoint as slime's Megatron-LM saves it (the distributed optimizer `dp_reshardable`, its content metadata
    written), resumed by checkpoint.load_optimizer: the next step equals the saving run's."""
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from slime.backends.megatron_utils import checkpoint
    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_parallel, unwrap
    from slime.utils.net import free_port
    from tests.args import make_args
    from tests.conftest import model_args

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    args = make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--bf16", "--lr", "1e-3")
    initialize_parallel(args)

    def step(model, optimizer, scale: float) -> None:  # gradients of varying size: Adam's update depends on its state
        for chunk in model:
            chunk.zero_grad_buffer()
        (scale * sum(p.float().sum() for p in model[0].parameters())).backward()
        assert optimizer.step()[0]

    model = build_model(args)
    optimizer = build_optimizer(args, model, total_steps=4)[0]
    initial = [p.detach().clone() for p in model[0].parameters()]
    for scale in (1.0, 3.0):
        step(model, optimizer, scale)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}  # Megatron-LM's defaults (not --dist-ckpt-optim-fully-reshardable)
    sharded = {"model": unwrap(model[0]).sharded_state_dict()}
    sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"], metadata=metadata)
    path = f"{root}/iter_0000002"
    os.makedirs(path)
    dist_checkpointing.save(sharded, path, content_metadata=metadata)

    resumed = build_model(args)
    resumed_optimizer = build_optimizer(args, resumed, total_steps=4)[0]
    ckpt = checkpoint.find_checkpoint(path)
    checkpoint.load_model(ckpt, resumed)
    checkpoint.load_optimizer(ckpt, resumed, resumed_optimizer)
    step(model, optimizer, 0.5)
    step(resumed, resumed_optimizer, 0.5)
    pairs = list(zip(model[0].parameters(), resumed[0].parameters()))
    out.put({"keys": sorted({k.split(".")[1] for k in dist_checkpointing.load_tensors_metadata(path)
                             if k.startswith("optimizer.")}),
             "max_diff": max((a.float() - b.float()).abs().max().item() for a, b in pairs),
             "moved": min((a.float() - b.float()).abs().max().item() for a, b in zip(model[0].parameters(), initial))})
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_checkpoint_in_megatron_lms_dp_reshardable_format_resumes(tmp_path):
    result = spawned_result(resumes_megatron_lm_format, str(tmp_path))
    assert result["keys"] == ["distributed"], result  # the format slime's checkpoints have, not this repo's own
    assert result["moved"] > 0, result  # three steps moved every weight off the initial ones
    assert result["max_diff"] == 0.0, result  # the resumed optimizer steps as the saving one
