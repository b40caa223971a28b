"""slime/backends/megatron_utils/wgrad_fusion.py on a real GPU (skipped without CUDA): this torch adds a bf16
weight-gradient product into an fp32 buffer in one GEMM (`addmm(out_dtype=float32)` into itself), the sum is an
fp32 sum of the exact products (closer to fp64's than the bf16-rounded gradient added afterwards, megatron-core's
path without the fusion), and it is no slower than that path. Prints both paths' milliseconds at the 4B shape's
largest linear layer (fc1: 2560 -> 2 x 9728) for a micro-batch of 4,352 tokens."""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron_utils import wgrad_fusion
from tests.gpu.timing import cuda_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_accumulator_adds_bf16_products_into_fp32_in_one_gemm():
    assert wgrad_fusion.supported(), "this torch cannot addmm a bf16 product into fp32 (see the log line)"
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, out = 4352, 2560, 2 * 9728
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    dy = (torch.randn(tokens, out, device="cuda", generator=g) * 1e-2).to(torch.bfloat16)
    start = torch.randn(out, hidden, device="cuda", generator=g)
    exact = start.double() + dy.double().t() @ x.double()

    fused = start.clone()
    wgrad_fusion.accumulate(x, dy, fused)
    apart = start.clone()
    apart.add_(dy.t() @ x)  # megatron-core without the fusion: a bf16 gradient, added by the DDP hook
    fused_error = (fused.double() - exact).abs().max().item()
    apart_error = (apart.double() - exact).abs().max().item()
    print(f"[wgrad fusion] max |error| vs fp64: fused {fused_error:.2e}, bf16 gradient added {apart_error:.2e}")
    assert fused_error < apart_error / 4

    buffer = start.clone()
    fused_ms = cuda_ms(lambda: wgrad_fusion.accumulate(x, dy, buffer))
    apart_ms = cuda_ms(lambda: buffer.add_(dy.t() @ x))
    print(f"[wgrad fusion] fc1's weight gradient into fp32, {tokens} tokens: fused {fused_ms:.3f} ms, "
          f"GEMM then add {apart_ms:.3f} ms")
    assert fused_ms <= apart_ms * 1.05


def test_same_dtype_buffers_accumulate_in_place():
    """A bf16 main_grad (--grad-reduce-in-bf16's): addmm_ into it."""
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    buffer = torch.zeros(48, 32, device="cuda", dtype=torch.bfloat16)
    wgrad_fusion.accumulate(x, dy, buffer)
    wgrad_fusion.accumulate(x, dy, buffer)
    torch.testing.assert_close(buffer.float(), 2 * (dy.float().t() @ x.float()), rtol=2e-2, atol=2e-2)
