"""slime/backends/megatron_utils/fused_norm.py on a real GPU (skipped without CUDA): the Triton RMSNorm against
torch's at the 4B shape's norms for a micro-batch of 4,352 tokens (the hidden norm, [4352, 2560]; the q norm,
[4352, 32, 128]; bf16): the output within two units in the last place of fp64's, the gradients close to fp64's as
torch's are, and forward + backward milliseconds of both printed (the speed is acceptance row 31's)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.timing import cuda_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("shape", [(4352, 2560), (4352, 32, 128)], ids=["hidden", "q_norm"])
def test_triton_rms_norm_matches_torchs_on_the_gpu(shape):
    from slime.backends.megatron_utils.fused_norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    n = shape[-1]
    x = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    dy = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    dx64, dw64 = torch.autograd.grad(exact, (x64, w64), dy.double())

    def run(norm):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = norm(xi, wi)
        dx, dw = torch.autograd.grad(y, (xi, wi), dy)
        return y, dx, dw

    ours = run(lambda a, b: rms_norm(a, b, 1e-6))
    torchs = run(lambda a, b: torch.nn.functional.rms_norm(a, (n,), b, 1e-6))
    ulp = exact.detach().abs().clamp_min(1e-30).log2().floor().exp2() * 2**-7
    assert ((ours[0].double() - exact.detach()).abs() <= 2 * ulp).all()
    for got, want, base in ((ours[1], dx64, torchs[1]), (ours[2], dw64, torchs[2])):
        ours_err = (got.double() - want).abs().max().item()
        torch_err = (base.double() - want).abs().max().item()
        assert ours_err <= 1.5 * torch_err + 1e-6, (ours_err, torch_err)

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ms = {name: cuda_ms(lambda f=f: torch.autograd.grad(f(xr, wr), (xr, wr), dy))
          for name, f in (("triton", lambda a, b: rms_norm(a, b, 1e-6)),
                          ("torch", lambda a, b: torch.nn.functional.rms_norm(a, (n,), b, 1e-6)))}
    print(f"[fused norm] {list(shape)} bf16 forward + backward: triton {ms['triton']:.3f} ms, "
          f"torch {ms['torch']:.3f} ms")
