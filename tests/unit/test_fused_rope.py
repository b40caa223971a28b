"""The Megatron trainer's Triton rotary embedding of packed micro-batches (slime/backends/megatron_utils/fused_rope.py,
`--rope-kernel triton`) against megatron-core's rotation, run by Triton's interpreter on CPU (`TRITON_INTERPRET=1`,
set before the kernel is defined, so in a process of its own): forward and gradient in fp64 arithmetic terms on
packed sequences (positions restarting per sequence, the whole-pack table, a partial rotation, mscale), bf16 within
a unit in the last place, through packed_rope.py's patched function, and the calls left to megatron-core."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.interpreted import run_interpreted

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


def _table(positions: int, rot: int) -> torch.Tensor:
    """megatron-core's [P, 1, 1, R] frequency table (rotate-half layout: the angles twice)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([angles, angles], -1)[:, None, None]


def _megatron(t: torch.Tensor, freqs: torch.Tensor, rows: torch.Tensor, mscale: float) -> torch.Tensor:
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[rows], False, False, mscale).squeeze(1)


def _against_megatron() -> None:
    from slime.backends.megatron_utils import fused_rope
    from slime.backends.megatron_utils.packed_rope import token_positions

    assert fused_rope.INTERPRETED
    cu = torch.tensor([0, 7, 8, 20, 25])
    rows = token_positions(cu, 25)
    cases = [(5, 16, 16, 1.0), (3, 24, 16, 1.0), (4, 32, 32, 1.3)]  # (heads, head dim, rotated dims, mscale)
    for heads, dim, rot, mscale in cases:
        gen = torch.Generator().manual_seed(heads)
        t = torch.randn(25, heads, dim, generator=gen, dtype=torch.float64)
        g = torch.randn(25, heads, dim, generator=gen, dtype=torch.float64)
        freqs = _table(12, rot)
        want = _megatron(t.requires_grad_(), freqs.double(), rows, mscale)
        (want_grad,) = torch.autograd.grad(want, t, g)
        x = t.detach().float().requires_grad_()
        got = fused_rope.fused_rope(x, freqs, rows, mscale)
        (got_grad,) = torch.autograd.grad(got, x, g.float())
        assert fused_rope.covered(x, freqs, False, False)
        assert (got.double() - want).abs().max().item() < 1e-5, (heads, dim, rot)
        assert (got_grad.double() - want_grad).abs().max().item() < 1e-5, (heads, dim, rot)
    # bf16: megatron-core rounds cos / sin and every product, the kernel once: a unit or two in the last place
    t = torch.randn(25, 4, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    freqs = _table(12, 64)
    got = fused_rope.fused_rope(t, freqs, rows)
    want = _megatron(t.double(), freqs.double(), rows, 1.0)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max().item() <= 2 * 2 ** -8 * want.abs().max().item()


def _through_packed_rope() -> None:
    """packed_rope.py's patched megatron-core function with `--rope-kernel triton` gives its torch form's rotation
    and gradient, with per-sequence positions and with the whole-pack table."""
    from megatron.core.models.common.embeddings import rope_utils

    from slime.backends.megatron_utils import fused_rope, packed_rope

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    calls = []
    kernel = packed_rope.fused_rope
    packed_rope.fused_rope = lambda *a: calls.append(1) or kernel(*a)
    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    original = rope_utils._apply_rotary_pos_emb_thd
    try:
        for whole_pack in (False, True):
            freqs = _table(17 if whole_pack else 11, 32)
            t = torch.randn(17, 6, 32, generator=torch.Generator().manual_seed(int(whole_pack)))
            out = {}
            for kernel_name in fused_rope.KERNELS:
                assert packed_rope.install(kernel_name)
                x = t.clone().requires_grad_()
                y = rope_utils._apply_rotary_pos_emb_thd(x, cu, freqs, False, False, 1.0, OneRank())
                y.sum().backward()
                out[kernel_name] = (y.detach(), x.grad)
            assert torch.allclose(out["triton"][0], out["torch"][0], atol=1e-5, rtol=0)
            assert torch.allclose(out["triton"][1], out["torch"][1], atol=1e-5, rtol=0)
        assert len(calls) == 2  # once per form's triton run; interleaved calls below keep megatron-core's
        assert packed_rope.install("triton")
        freqs = _table(11, 32)
        rope_utils._apply_rotary_pos_emb_thd(torch.randn(17, 6, 32), cu, freqs, True, False, 1.0, OneRank())
        assert len(calls) == 2
    finally:
        rope_utils._apply_rotary_pos_emb_thd = original
        packed_rope.fused_rope = kernel


@pytest.mark.parametrize("case", ["_against_megatron", "_through_packed_rope"])
def test_fused_rope_in_the_interpreter(case):
    run_interpreted(f"from tests.unit.test_fused_rope import {case}; {case}()")


def test_the_flag_is_refused_where_the_kernel_cannot_run_and_off_cuda_nothing_is_covered():
    from slime.backends.megatron_utils import fused_rope
    from slime.config.arguments import SlimeArgumentError
    from tests.args import make_args

    assert make_args().rope_kernel == "torch"  # auto, off CUDA
    # auto: the kernel where the Megatron trainer packs on CUDA with rope fusion on (and triton, here installed)
    megatron = ("--train-backend", "megatron")
    assert make_args(*megatron, use_cuda=True).rope_kernel == "triton"
    assert make_args(*megatron, "--no-rope-fusion", use_cuda=True).rope_kernel == "torch"
    assert make_args(*megatron, "--qkv-format", "bshd", use_cuda=True).rope_kernel == "torch"
    assert make_args("--train-backend", "fsdp", use_cuda=True).rope_kernel == "torch"
    with pytest.raises(SlimeArgumentError, match="--rope-kernel triton runs on CUDA only"):
        make_args("--rope-kernel", "triton", use_cuda=False)
    assert make_args("--rope-kernel", "triton", "--train-backend", "megatron", use_cuda=True).rope_kernel == "triton"
    for other in (["--train-backend", "fsdp"], ["--train-backend", "megatron", "--qkv-format", "bshd"]):
        with pytest.raises(SlimeArgumentError, match="--rope-kernel triton rotates the Megatron trainer's packed"):
            make_args("--rope-kernel", "triton", *other, use_cuda=True)
    if not fused_rope.INTERPRETED:
        assert not fused_rope.covered(torch.randn(3, 2, 16), _table(4, 16), False, False)
