"""`--log-probs-kernel triton` on a GPU (GPU acceptance row 27): at the Megatron trainer's shape (bf16 logits of
Qwen3's 151,936 words, the response rows of a packed micro-batch of 20,480 tokens) the Triton kernels give the torch
form's log-probs, entropy and gradient to fp32 / bf16 rounding, and their forward + backward time beside the torch
form's is printed (`[log-probs kernel]`; the speed-up is what benchmarks/megatron_train.py --layouts thd,thd:triton
then shows in a training step)."""

from __future__ import annotations

import time

import pytest
import torch

from slime.algorithm.log_probs_triton import vocab_kernel

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOKENS, VOCAB, PADDED = 20480, 151936, 152064  # a micro-batch; Qwen3's vocabulary, Megatron's padding to 128 × TP


def run(kernel: str, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
    x = logits.detach().clone().requires_grad_()
    lp, ent = vocab_kernel(kernel)(x, targets, temperature=0.8, with_entropy=True, rows=rows, vocab_size=VOCAB)
    (lp @ weights[0] + ent @ weights[1]).backward()
    return lp.detach(), ent.detach(), x.grad


def exact_gradient(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, t: float):
    """In fp64, the gradient of Σ w0·log p(target) + w1·entropy over rows of `logits` at temperature `t`, and the
    size of its terms (what its fp32 computation is rounded against): g = (w0·(onehot - p) - w1·p·(x - E[x])) / t."""
    x = logits.double() / t
    p = (x - x.logsumexp(-1, keepdim=True)).exp()
    mean = (p * x).sum(-1, keepdim=True)
    onehot = torch.zeros_like(x).scatter_(-1, targets.unsqueeze(-1), 1.0)
    w0, w1 = weights[0].unsqueeze(-1), weights[1].unsqueeze(-1)
    exact = (w0 * (onehot - p) - w1 * p * (x - mean)) / t
    size = (w0.abs() * (onehot + p) + w1.abs() * p * (x.abs() + mean.abs())) / t
    return exact, size


def timed(kernel: str, *inputs) -> float:
    run(kernel, *inputs)  # compile / warm up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        run(kernel, *inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 3


def test_triton_kernels_match_the_torch_form_at_the_trainers_shape():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(TOKENS, PADDED, device="cuda", generator=g)).to(torch.bfloat16)
    rows = torch.randperm(TOKENS, device="cuda", generator=g)[: TOKENS * 3 // 4].sort().values  # the responses
    targets = torch.randint(0, VOCAB, (rows.numel(),), device="cuda", generator=g)
    weights = torch.randn(2, rows.numel(), device="cuda", generator=g)
    ours, want = run("triton", logits, rows, targets, weights), run("torch", logits, rows, targets, weights)
    # log-probs and entropy (~12 at this vocabulary) to fp32 rounding
    for a, b, name in zip(ours[:2], want[:2], ("log-probs", "entropy")):
        err = (a - b).abs().max().item()
        assert err <= 1e-5 * b.abs().max().item(), f"{name}: {err:.3g}"
    # the bf16 gradient of each form against fp64, element by element: within half a bf16 unit of the exact value plus
    # 2^-14 of the size of its terms (the fp32 sums over 151,936 words differ from the exact ones by ~2^-17; where
    # the log-prob and entropy terms cancel, that, not the rounding to bf16, is the whole difference; on the H100 the
    # two forms differed by more than one bf16 unit there). Unread rows and padding columns must stay exactly zero.
    read_weights = torch.zeros(2, TOKENS, dtype=torch.float64, device="cuda")
    read_weights[:, rows] = weights.double()
    read_targets = torch.zeros(TOKENS, dtype=torch.long, device="cuda")
    read_targets[rows] = targets
    for start in range(0, TOKENS, 1024):  # in blocks of rows: fp64 copies of a block are 1.2 GB each
        block = slice(start, start + 1024)
        exact, size = exact_gradient(logits[block, :VOCAB], read_targets[block], read_weights[:, block], 0.8)
        for grad, name in ((ours[2], "triton"), (want[2], "torch")):
            err = (grad[block, :VOCAB].double() - exact).abs()
            worst = (err - 2**-8 * exact.abs() - 2**-14 * size).max().item()
            assert worst <= 0, f"{name} gradient, rows {start}..: {worst:.3g} past its bound"
    assert ours[2][:, VOCAB:].abs().max().item() == 0
    fused, plain = timed("triton", logits, rows, targets, weights), timed("torch", logits, rows, targets, weights)
    print(f"\n[log-probs kernel] {rows.numel()} rows x {VOCAB} words, bf16, forward + backward: torch "
          f"{plain * 1e3:.1f} ms, triton {fused * 1e3:.1f} ms ({plain / fused:.2f}x)")
