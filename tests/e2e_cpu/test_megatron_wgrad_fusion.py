"""Megatron's gradient accumulation fusion through slime's accumulator (slime/backends/megatron_utils/wgrad_fusion.py):
megatron-core's real linear layers and DDP chunks, built by the backend's `build_model` on the CPU shim
(tests/megatron_cpu_shim.py), one gloo rank per child process. Two micro-batches' backward passes accumulate into
`main_grad`; with the fusion the weight-gradient GEMMs add into it themselves (the DDP hook skips their gradients)
and every gradient must come out as without it. The tied case is the one that can lose a gradient: the output
layer's GEMM adds into the shared weight's `main_grad` while the embedding lookup's gradient still goes through the
hook. On CPU the accumulator adds a plain product (the CUDA form, `addmm(out_dtype=float32)`, is
tests/gpu/test_wgrad_fusion_gpu.py's)."""

from __future__ import annotations

import importlib.util
import pytest

from tests.forkserver import spawned_result

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def _main_grads(out, fused: bool, tied: bool) -> None:
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    import torch
    import torch.distributed as dist

    from slime.backends.megatron_utils import wgrad_fusion
    from slime.backends.megatron_utils.model import build_model, initialize_parallel
    from tests.args import make_args
    from tests.conftest import model_args

    wgrad_fusion.supported = lambda: True  # the CUDA probe; the accumulator's CPU form stands in for the GEMM
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    flags = [f for f in model_args("tiny-qwen3") if not (tied and f == "--untie-embeddings-and-output-weights")]
    args = make_args(*flags, "--train-backend", "megatron",
                     *([] if fused else ["--no-gradient-accumulation-fusion"]))
    initialize_parallel(args)
    torch.manual_seed(0)
    model = build_model(args)
    from megatron.core.tensor_parallel import layers

    calls = []
    if fused:
        accumulate = layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 = (
            lambda x, dy, g: (calls.append(tuple(g.shape)), accumulate(x, dy, g)))
    chunk = model[0]
    chunk.zero_grad_buffer()
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # two micro-batches into the same main_grad
        ids = torch.randint(3, args.vocab_size, (2, 16), generator=g)
        positions = torch.arange(16).unsqueeze(0).expand_as(ids)
        logits = chunk(ids, positions, None)
        (logits.float() * torch.randn(logits.shape, generator=g)).sum().backward()
    grads = {name: p.main_grad.numpy().copy() for name, p in chunk.named_parameters()}  # by value through the queue
    out.put({"fusion": chunk.config.gradient_accumulation_fusion, "calls": len(calls),
             "grads": grads, "left_grads": sum(p.grad is not None for p in chunk.parameters())})
    dist.destroy_process_group()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_weight_gradients_equal_the_hooks_sums(tied):
    import torch

    fused, plain = spawned_result(_main_grads, True, tied), spawned_result(_main_grads, False, tied)
    assert fused["fusion"] is True and plain["fusion"] is False
    linears = 4 * 4 + 1  # qkv, proj, fc1, fc2 per layer, and the output layer; two micro-batches each
    assert fused["calls"] == 2 * linears and plain["calls"] == 0
    assert fused["left_grads"] == plain["left_grads"] == 0
    assert fused["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():
        assert abs(grad).sum() > 0, name
        torch.testing.assert_close(torch.from_numpy(fused["grads"][name]), torch.from_numpy(grad), rtol=1e-5,
                                   atol=1e-6, msg=name)
