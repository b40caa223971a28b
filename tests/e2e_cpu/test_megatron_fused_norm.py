"""`--norm-kernel triton` in a real megatron-core model (slime/backends/megatron_utils/fused_norm.py): the backend's
`build_model` on the CPU shim (tests/megatron_cpu_shim.py), one gloo rank, with the Triton kernels run by Triton's
interpreter in a process of its own. Its norms (input, pre-MLP, q, k, final) are the fused module, and its logits
and every weight's gradient (two micro-batches accumulated into `main_grad`) are those of the same model with
torch's RMSNorm, to fp32 rounding. (Parsing refuses the flag without CUDA; the test sets it after parsing.)"""

from __future__ import annotations

import importlib.util

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def _run(norm_kernel: str) -> dict:
    import torch

    from slime.backends.megatron_utils.model import build_model
    from tests.args import make_args
    from tests.conftest import model_args

    args = make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron")
    args.norm_kernel = norm_kernel
    torch.manual_seed(0)
    chunk = build_model(args)[0]
    chunk.zero_grad_buffer()
    g = torch.Generator().manual_seed(1)
    logits = []
    for _ in range(2):
        ids = torch.randint(3, args.vocab_size, (2, 16), generator=g)
        out = chunk(ids, torch.arange(16).unsqueeze(0).expand_as(ids), None)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        logits.append(out.detach())
    kinds = sorted({type(m).__name__ for m in chunk.modules() if "Norm" in type(m).__name__})
    return {"kinds": kinds, "logits": logits, "grads": {n: p.main_grad.clone() for n, p in chunk.named_parameters()}}


def _fused_against_torch() -> None:
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    import torch
    import torch.distributed as dist

    from slime.backends.megatron_utils import fused_norm
    from slime.backends.megatron_utils.model import initialize_parallel
    from tests.args import make_args
    from tests.conftest import model_args

    assert fused_norm.INTERPRETED
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    initialize_parallel(make_args(*model_args("tiny-qwen3"), "--train-backend", "megatron"))
    fused, plain = _run("triton"), _run("torch")
    assert fused["kinds"] == ["FusedRMSNorm"] and plain["kinds"] == ["RMSNorm"], (fused["kinds"], plain["kinds"])
    for a, b in zip(fused["logits"], plain["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert fused["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(fused["grads"][name], grad, rtol=1e-3, atol=1e-4, msg=name)
    dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_a_model_with_the_triton_norms_computes_torchs_logits_and_gradients():
    run_interpreted("from tests.e2e_cpu.test_megatron_fused_norm import _fused_against_torch; _fused_against_torch()")
