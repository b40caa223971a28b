"""`--adam-kernel`: the torch AdamW that megatron-core builds without TransformerEngine / Apex, fused or torch's
default (slime/backends/megatron_utils/model.py, `set_adam_kernel`). Real megatron-core (the CPU shim here,
tests/megatron_cpu_shim.py; on a GPU tests/gpu/test_adam_kernel_gpu.py runs the same worker), bf16 chunks with the
distributed optimizer, one rank in a child process. Two twin chunks take the same three steps, one per kernel: their
weights agree to rounding. Then a fresh fused model and optimizer resume from the unfused run's torch_dist checkpoint
(slime/backends/megatron_utils/checkpoint.py, `load_optimizer`): megatron-core's load of torch's Adam state works, the
fused kernel stays (torch's `load_state_dict` would take the saving run's), each parameter keeps a step counter of
its own (on a GPU, on the device), and the next step agrees with the unfused run's. A twin of the unfused run saved
before its first step (megatron-core's save of torch's Adam then needs a state: `_give_torch_adams_state`) steps as
the unfused run to the bit."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.args import make_args
from tests.conftest import model_args
from tests.forkserver import spawned_result

megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def adam_kernels(out, root: str) -> None:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        from tests import megatron_cpu_shim

        megatron_cpu_shim.install()
    import torch.distributed as dist

    from slime.backends.megatron_utils import checkpoint
    from slime.backends.megatron_utils.model import build_model, build_optimizer, initialize_parallel, torch_adams
    from slime.utils.net import free_port

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    kernels = ("fused", "unfused")
    args = {k: make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron", "--bf16", "--lr", "1e-2",
                         "--seed", "0", "--use-distributed-optimizer", "--adam-kernel", k) for k in kernels}
    initialize_parallel(args["fused"])
    args["saved_first"] = args["unfused"]  # the unfused run's twin, saved before its first step
    chunks = {k: build_model(args[k]) for k in args}
    with torch.no_grad():
        for k in ("unfused", "saved_first"):
            for a, b in zip(chunks["fused"][0].parameters(), chunks[k][0].parameters()):
                b.copy_(a)
    optimizers = {k: build_optimizer(args[k], chunks[k], total_steps=8)[0] for k in args}
    checkpoint.save(os.path.join(root, "fresh"), 0, chunks["saved_first"], optimizers["saved_first"])
    initial = [p.detach().clone() for p in chunks["fused"][0].parameters()]

    def flags(k: str) -> list:
        return sorted({str(g["fused"]) for a in torch_adams(optimizers[k]) for g in a.param_groups})

    def steps(k: str) -> list:
        return sorted({f"{s['step'].device.type}:{float(s['step']):g}" for a in torch_adams(optimizers[k])
                       for s in a.state.values()})

    def step(k: str, seed: int) -> None:
        for chunk in chunks[k]:
            chunk.zero_grad_buffer()
        optimizers[k].zero_grad()
        g = torch.Generator(device=device).manual_seed(seed)
        params = list(chunks[k][0].parameters())
        loss = sum((p.float() * torch.randn(p.shape, device=device, generator=g)).sum() for p in params)
        loss.backward()
        optimizers[k].step()

    result = {"built": {k: flags(k) for k in kernels}}
    for seed in range(3):
        for k in args:
            step(k, seed)
    pairs = list(zip(chunks["fused"][0].parameters(), chunks["unfused"][0].parameters()))
    result["steps"] = {k: steps(k) for k in kernels}
    result["saved_first_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in
                                     zip(chunks["saved_first"][0].parameters(), chunks["unfused"][0].parameters()))
    result["max_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    result["moved"] = min(float((a.float() - b.float()).abs().max()) for a, b in
                          zip(chunks["fused"][0].parameters(), initial))
    checkpoint.save(root, 0, chunks["unfused"], optimizers["unfused"])
    # A fused run resumes from it (as MegatronTrainRayActor.init: a fresh model and optimizer, then the load).
    ckpt = checkpoint.find_checkpoint(root)
    chunks["resumed"] = build_model(args["fused"])
    checkpoint.load_model(ckpt, chunks["resumed"])
    optimizers["resumed"] = build_optimizer(args["fused"], chunks["resumed"], total_steps=8)[0]
    checkpoint.load_optimizer(ckpt, chunks["resumed"], optimizers["resumed"])
    result["loaded"] = {"flags": flags("resumed"), "steps": steps("resumed")}
    for k in ("resumed", "unfused"):
        step(k, 3)
    result["resumed"] = {"flags": flags("resumed"), "steps": steps("resumed")}
    result["resumed_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in
                                 zip(chunks["resumed"][0].parameters(), chunks["unfused"][0].parameters()))
    out.put(result)
    dist.destroy_process_group()


def check_adam_kernels(result: dict, device: str, tolerance: float = 4e-3) -> None:
    """What the workers here and in test_fsdp_adam_kernel.py found. `tolerance`: of the two kernels' weights after
    three steps (and after the resumed step)."""
    assert result["built"] == {"fused": ["True"], "unfused": ["None"]}, result
    assert result["steps"] == {"fused": [f"{device}:3"], "unfused": ["cpu:3"]}, result
    # The kernels round differently (fp32 moments and master weights); bf16 weights agree to about a unit in
    # their last place (7.8e-3 at 1) after three steps of lr 1e-2, each of which moved every weight by about lr.
    assert result["max_diff"] < tolerance and result["moved"] > 1e-2, result
    if "saved_first_diff" in result:
        # a save before the first step gives torch's Adam the zero state of its first step (megatron-core's
        # distributed optimizer reads the step count from it): the steps after it are a fresh Adam's, to the bit
        assert result["saved_first_diff"] == 0.0, result
    # The fused run resumed from the unfused run's checkpoint keeps its kernel and the step count, one per parameter
    # (megatron-core's load shares one counter among them all: stepped, each parameter would add one to it).
    assert result["loaded"] == {"flags": ["True"], "steps": [f"{device}:3"]}, result
    assert result["resumed"] == {"flags": ["True"], "steps": [f"{device}:4"]}, result
    assert result["resumed_diff"] < tolerance, result


@megatron
@pytest.mark.timeout(300)
def test_fused_and_unfused_adam_train_alike_and_a_checkpoint_keeps_the_kernel(tmp_path):
    check_adam_kernels(spawned_result(adam_kernels, str(tmp_path)), "cpu")

