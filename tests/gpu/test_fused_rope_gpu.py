"""`--rope-kernel triton` on a GPU (GPU acceptance row 30): at the Megatron trainer's shape (a packed micro-batch of
20,480 tokens of 64 sequences, Qwen3-0.6B's 16 query heads of 128) the Triton rotation gives megatron-core's rotation
and gradient (fp32 to 1e-5; bf16 within two units in the last place of the largest value), and both forms' forward +
backward time is printed (`[rope kernel]`; benchmarks/megatron_train.py --layouts thd:triton,thd:triton+rope shows
what it does to a training step)."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")]

TOKENS, SEQUENCES, HEADS, DIM = 20480, 64, 16, 128


def _table(positions: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (1e6 ** (torch.arange(0, rot, 2, dtype=torch.float32, device="cuda") / rot))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32, device="cuda"), inv)
    return torch.cat([angles, angles], -1)[:, None, None]


def _forms(t: torch.Tensor, freqs: torch.Tensor, rows: torch.Tensor, g: torch.Tensor):
    from megatron.core.models.common.embeddings import rope_utils

    from slime.backends.megatron_utils.fused_rope import covered, fused_rope

    assert covered(t, freqs, False, False)
    out = {}
    for name, rotate in (("torch", lambda x: rope_utils._apply_rotary_pos_emb_bshd(
            x.unsqueeze(1), freqs[rows], False, False, 1.0).squeeze(1)),
            ("triton", lambda x: fused_rope(x, freqs, rows))):
        x = t.detach().clone().requires_grad_()
        y = rotate(x)
        y.backward(g)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            x.grad = None
            rotate(x).backward(g)
        torch.cuda.synchronize()
        out[name] = (y.detach(), x.grad, (time.perf_counter() - start) / 10 * 1e3)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rotation_equals_megatron_cores_at_the_trainers_shape(dtype):
    from slime.backends.megatron_utils.packed_rope import token_positions

    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.full((SEQUENCES,), TOKENS // SEQUENCES)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
    rows = token_positions(cu, TOKENS)
    freqs = _table(TOKENS // SEQUENCES, DIM)
    t = torch.randn(TOKENS, HEADS, DIM, generator=gen, device="cuda").to(dtype)
    g = torch.randn(TOKENS, HEADS, DIM, generator=gen, device="cuda").to(dtype)
    forms = _forms(t, freqs, rows, g)
    (y0, g0, ms0), (y1, g1, ms1) = forms["torch"], forms["triton"]
    if dtype == torch.float32:
        tol_y = tol_g = 1e-5
    else:  # megatron-core rounds cos, sin and each product to bf16; the kernel rounds once
        tol_y, tol_g = 2 * 2 ** -8 * y0.abs().max().item(), 2 * 2 ** -8 * g0.abs().max().item()
    assert (y1.float() - y0.float()).abs().max().item() <= tol_y
    assert (g1.float() - g0.float()).abs().max().item() <= tol_g
    print(f"[rope kernel] {dtype}, {TOKENS} tokens × {HEADS} heads × {DIM}: forward + backward {ms0:.3f} ms "
          f"(megatron-core) vs {ms1:.3f} ms (triton)")
