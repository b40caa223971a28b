"""`--attention-kernel cudnn`'s packed route (sdpa_attention.py): a packed micro-batch right-padded to its longest
sequence when that adds at most half again to its causal attention FLOPs, attended there and gathered back; and
the flag's resolution. On the CPU SDPA runs its own kernels under the same priority list, so the scatter, the
padded causal attention and the gather are checked here exactly (fp64); tests/gpu/test_megatron_gpu.py checks
cuDNN's kernel itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slime.backends.megatron_utils import sdpa_attention
from slime.backends.megatron_utils.forward import packed_seq_params
from slime.backends.megatron_utils.sdpa_attention import pad_rows, padded_causal, padded_rows, unpad_rows
from slime.utils.errors import SlimeArgumentError
from tests.args import make_args
from tests.autograd_graph import node_names


@pytest.fixture
def cudnn_kernel():
    sdpa_attention.install("cudnn")
    yield
    sdpa_attention.install("flash")


def test_the_layout_puts_each_sequence_at_the_start_of_its_own_row():
    rows = padded_rows([0, 6, 13, 20])
    assert (rows.lengths, rows.sequences, rows.longest, rows.viewed) == ((6, 7, 7), 3, 7, False)
    x = torch.arange(1, 21).unsqueeze(1).expand(20, 2)
    padded = pad_rows(x, rows)
    assert padded[:, 0].tolist() == [*range(1, 7), 0, *range(7, 21)] and padded[:, 1].equal(padded[:, 0])
    assert unpad_rows(padded, rows).equal(x)


def test_padding_that_adds_more_than_half_the_flops_stays_packed():
    # 4 x 7² = 196 against 25 + 49 + 1 + 49 = 124: 1.58x
    assert padded_rows([0, 5, 12, 13, 20]) is None
    # two long sequences and the pad sequence sequence parallelism adds: 3 x 4096² ≈ 1.5 x (2 x 4096² + 3²)
    assert padded_rows([0, 4096, 8192, 8195]) is not None
    assert padded_rows([0, 4096, 8192, 8196]) is not None
    assert padded_rows([0, 4096, 4100]) is None


def test_sequences_of_one_length_are_the_padded_layout_as_they_are():
    rows = padded_rows([0, 7, 14, 21])
    assert (rows.sequences, rows.longest, rows.viewed) == (3, 7, True)


def test_flash_kernel_never_pads():
    sdpa_attention.install("flash")
    assert packed_seq_params([0, 6, 13, 20], "cpu").padded_rows is None


def test_packed_seq_params_carry_the_layout(cudnn_kernel):
    params = packed_seq_params([0, 6, 13, 20], "cpu")
    assert params.padded_rows == padded_rows([0, 6, 13, 20])
    assert params.max_seqlen_q == 7


@pytest.mark.parametrize("cu", [[0, 6, 13, 20], [0, 7, 14, 21]], ids=["padded", "one-length"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_padded_attention_equals_each_sequence_alone(kv_heads, cu):
    """Output and the three gradients, grouped (2 key/value heads for 4 query heads) and not, to fp64 rounding;
    sequences of one length without a copy, others padded and gathered back by one copy each way."""
    torch.manual_seed(0)
    t = cu[-1]
    q = torch.randn(t, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(t, kv_heads, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = padded_causal(q, k, v, padded_rows(cu), 0.3)
    nodes = node_names(out)
    assert ("_RelayoutBackward" in nodes) == (cu[-1] == 20)
    assert not any("Copy" in n or "Clone" in n for n in nodes), nodes
    grad = torch.randn_like(out)
    out.backward(grad)
    ours = [x.grad.clone() for x in (q, k, v)]
    qf, kf, vf = (x.detach().clone().requires_grad_() for x in (q, k, v))
    group = 4 // kv_heads
    ref = torch.cat([
        F.scaled_dot_product_attention(qf[a:b].transpose(0, 1), kf[a:b].repeat_interleave(group, 1).transpose(0, 1),
                                       vf[a:b].repeat_interleave(group, 1).transpose(0, 1), is_causal=True,
                                       scale=0.3).transpose(0, 1)
        for a, b in zip(cu[:-1], cu[1:])])
    ref.backward(grad)
    assert out.shape == (t, 4, 8)
    assert (out - ref).abs().max() < 1e-12
    for mine, exact in zip(ours, (qf.grad, kf.grad, vf.grad)):
        assert (mine - exact).abs().max() < 1e-12


def test_flash_is_the_default_and_cudnn_needs_cuda_without_deterministic_mode():
    megatron = ("--train-backend", "megatron")
    assert make_args(*megatron, use_cuda=True).attention_kernel == "flash"
    assert make_args(*megatron, "--attention-kernel", "cudnn", use_cuda=True).attention_kernel == "cudnn"
    with pytest.raises(SlimeArgumentError, match="--attention-kernel cudnn runs on CUDA only"):
        make_args(*megatron, "--attention-kernel", "cudnn", use_cuda=False)
    with pytest.raises(SlimeArgumentError, match="--attention-kernel cudnn with --deterministic-mode"):
        make_args(*megatron, "--attention-kernel", "cudnn", "--deterministic-mode", use_cuda=True)
