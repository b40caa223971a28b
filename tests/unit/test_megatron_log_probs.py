"""The Megatron backend's chunked log-probs (slime/backends/megatron_utils/log_probs.py) against plain autograd:
values and gradients, with Megatron's vocabulary padding, a temperature, a subset of rows, several chunks, and
the vocabulary split over two ranks of a real gloo group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime.backends.megatron_utils import log_probs as lp_module
from slime.backends.megatron_utils.log_probs import chunked_log_probs

T, V, REAL = 12, 40, 37  # logits rows, padded vocabulary, real vocabulary (Megatron pads at the end)


def reference(logits, rows, targets, temperature):
    x = logits[rows, :REAL].to(torch.float64) / temperature
    log_p = torch.log_softmax(x, dim=-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(T, V, generator=g)).to(dtype)
    rows = torch.tensor([1, 2, 3, 5, 8, 9, 10])
    targets = torch.randint(0, REAL, (rows.numel(),), generator=g)
    weights = torch.randn(2, rows.numel(), generator=g, dtype=torch.float64)
    return logits, rows, targets, weights


def grads(fn, logits, weights):
    x = logits.detach().clone().requires_grad_()
    lp, ent = fn(x)
    (lp.double() @ weights[0] + ent.double() @ weights[1]).backward()
    return lp.detach().double(), ent.detach().double(), x.grad.double()


# the gradient comes back in the logits' dtype: bf16 rounds it (2^-8 relative)
@pytest.mark.parametrize("dtype,tol,grad_tol", [(torch.float64, 1e-10, 1e-10), (torch.float32, 1e-5, 1e-5),
                                                (torch.bfloat16, 1e-5, 2**-8)])
def test_equals_plain_autograd_in_several_chunks(monkeypatch, dtype, tol, grad_tol):
    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", 3 * REAL)  # 3 rows per chunk
    logits, rows, targets, weights = inputs(dtype)
    ours = grads(lambda x: chunked_log_probs(x, targets, REAL, True, 0.7, rows), logits, weights)
    # the reference sees the same (rounded) logits, in fp64
    want = grads(lambda x: reference(x, rows, targets, 0.7), logits.double(), weights)
    for a, b, name, t in zip(ours, want, ("log-probs", "entropy", "gradient"), (tol, tol, grad_tol)):
        assert (a - b).abs().max() < t * max(1.0, b.abs().max()), name
    assert ours[2][:, REAL:].abs().max() == 0 and ours[2][[0, 4, 6, 7, 11]].abs().max() == 0  # unread: no grad


def test_without_entropy_and_an_unused_output():
    logits, rows, targets, weights = inputs(torch.float32)
    x = logits.clone().requires_grad_()
    lp, ent = chunked_log_probs(x, targets, REAL, False, 1.0, rows)
    assert ent is None
    lp.sum().backward()
    y = logits.clone().requires_grad_()
    reference(y, rows, targets, 1.0)[0].sum().backward()
    assert (x.grad - y.grad).abs().max() < 1e-5


def _rank(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    logits, rows, targets, weights = inputs(torch.float32)
    local = V // 2
    part = logits[:, rank * local:(rank + 1) * local]
    lp, ent, grad = grads(lambda x: chunked_log_probs(x, targets, REAL, True, 0.7, rows, dist.group.WORLD, rank),
                          part, weights)
    torch.save({"lp": lp, "ent": ent, "grad": grad}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_vocabulary_split_over_two_ranks(tmp_path):
    mp.spawn(_rank, args=(f"file://{tmp_path / 'init'}", str(tmp_path / "out")), nprocs=2, join=True)
    logits, rows, targets, weights = inputs(torch.float32)
    want = grads(lambda x: reference(x, rows, targets, 0.7), logits.double(), weights)
    got = [torch.load(f"{tmp_path / 'out'}.{r}") for r in range(2)]
    for r in got:  # both ranks return the whole distribution's log-probs and entropy
        assert (r["lp"] - want[0]).abs().max() < 1e-5 and (r["ent"] - want[1]).abs().max() < 1e-5
    grad = torch.cat([got[0]["grad"], got[1]["grad"]], dim=1)  # each rank's gradient is its own slice's
    assert (grad - want[2]).abs().max() < 1e-5
    assert os.path.exists(f"{tmp_path / 'out'}.1")
