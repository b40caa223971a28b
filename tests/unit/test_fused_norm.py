"""The Megatron trainer's Triton RMSNorm (slime/backends/megatron_utils/fused_norm.py, `--norm-kernel triton`): the
kernels against RMSNorm in fp64 arithmetic, run by Triton's interpreter on CPU (`TRITON_INTERPRET=1`, set before the
kernels are defined, so in a process of its own): forward, the input's and the weight's gradients over row counts
that do and do not fill the blocks and the backward's programs, hidden sizes of a power of two and not, bf16 within a
unit in the last place, a frozen weight; then the spec swap on megatron-core's real local decoder block spec, and the
module's parameter and fallbacks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.interpreted import run_interpreted
from tests.unit.test_sequence_parallel_norm import _config, _norm_classes

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _against_fp64() -> None:
    from slime.backends.megatron_utils import fused_norm

    assert fused_norm.INTERPRETED
    # (rows, hidden): q/k norms' 128 with rows past one block, a hidden size not a power of two, a 4B-like row,
    # rows spread over more blocks than the backward's 4 CPU programs
    for rows, n in [(70, 128), (5, 96), (3, 2560), (300, 32)]:
        gen = torch.Generator().manual_seed(rows + n)
        x = torch.randn(rows, n, generator=gen, dtype=torch.float64) * 3
        w = torch.randn(n, generator=gen, dtype=torch.float64)
        g = torch.randn(rows, n, generator=gen, dtype=torch.float64)
        want = _reference(x.requires_grad_(), w.requires_grad_(), 1e-6)
        want_dx, want_dw = torch.autograd.grad(want, (x, w), g)
        xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        got = fused_norm.rms_norm(xf, wf, 1e-6)
        got_dx, got_dw = torch.autograd.grad(got, (xf, wf), g.float())
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_dx.double(), want_dx, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_dw.double(), want_dw, rtol=1e-4, atol=1e-3)

    # leading dimensions kept ([tokens, heads, head_dim] of the q/k norms), bf16 within a unit in the last place of
    # the fp32 computation rounded once
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 4, 64, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    got = fused_norm.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    exact = _reference(x.double(), w.double(), 1e-6)
    ulp = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2**-7
    assert ((got.double() - exact).abs() <= ulp).all()

    # a frozen weight (LoRA's base): no weight gradient asked for, none computed
    xf = torch.randn(9, 128, generator=gen).requires_grad_()
    out = fused_norm.rms_norm(xf, torch.ones(128), 1e-6)
    (dx,) = torch.autograd.grad(out.sum(), (xf,))
    assert torch.isfinite(dx).all()


def test_kernels_against_fp64_under_the_interpreter():
    run_interpreted("from tests.unit.test_fused_norm import _against_fp64; _against_fp64()")


def test_the_swap_replaces_every_local_norm_of_the_decoder_block():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from slime.backends.megatron_utils.fused_norm import FusedRMSNorm, with_fused_norms
    from slime.backends.megatron_utils.sequence_parallel_norm import with_sequence_parallel_norms

    # what get_gpt_decoder_block_spec builds without TransformerEngine (it needs the parallel groups)
    layer = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    spec = TransformerBlockSubmodules(layer_specs=[layer, layer], layer_norm=WrappedTorchNorm)
    before = _norm_classes(spec)
    assert before == [WrappedTorchNorm] * (2 * 4 + 1)  # per layer: input, q, k and pre-MLP norms; the final norm
    assert _norm_classes(with_fused_norms(spec)) == [FusedRMSNorm] * len(before)
    assert _norm_classes(with_fused_norms(with_sequence_parallel_norms(spec))) == [FusedRMSNorm] * len(before)
    assert _norm_classes(spec) == before  # a copy: megatron-core's spec is left as it was


def test_the_module_has_torchs_parameter_and_falls_back_where_it_does_not_apply():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from slime.backends.megatron_utils.fused_norm import FusedRMSNorm

    cfg = _config(False)
    norm = FusedRMSNorm(cfg, 64, eps=1e-6)
    assert isinstance(norm, FusedRMSNorm)
    assert norm.state_dict().keys() == WrappedTorchNorm(cfg, 64, eps=1e-6).state_dict().keys() == {"weight"}
    assert norm.weight.sequence_parallel is False
    x = torch.randn(5, 64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-6))  # CPU: torch's

    assert FusedRMSNorm(_config(True), 64).weight.sequence_parallel is True
    layer_norm = _config(False)
    layer_norm.normalization = "LayerNorm"
    assert isinstance(FusedRMSNorm(layer_norm, 64), torch.nn.LayerNorm)


def test_the_flag_is_refused_where_it_would_not_act(monkeypatch):
    from slime.config.arg_groups import megatron as megatron_group
    from slime.config.arguments import SlimeArgumentError
    from tests.args import make_args

    megatron = ("--train-backend", "megatron", "--norm-kernel", "triton")
    assert make_args().norm_kernel == "torch"
    assert make_args(*megatron, use_cuda=True).norm_kernel == "triton"
    with pytest.raises(SlimeArgumentError, match="--norm-kernel triton runs on CUDA only"):
        make_args(*megatron, use_cuda=False)
    with pytest.raises(SlimeArgumentError, match="--norm-kernel triton replaces the norms of the Megatron trainer"):
        make_args("--train-backend", "fsdp", "--norm-kernel", "triton", use_cuda=True)
    with pytest.raises(SlimeArgumentError, match="--spec / --custom-model-provider-path"):
        make_args(*megatron, "--custom-model-provider-path", "tests.e2e_cpu.training_plugins:provider", use_cuda=True)
    monkeypatch.setattr(megatron_group.megatron_model, "te_available", lambda: True)
    with pytest.raises(SlimeArgumentError, match="TransformerEngine's layers"):
        make_args(*megatron, use_cuda=True)
    assert make_args(*megatron, "--transformer-impl", "local", use_cuda=True).norm_kernel == "triton"
