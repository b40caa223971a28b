"""The log-prob kernel (slime/algorithm/log_probs.py) against plain autograd: values and gradients, with
Megatron's vocabulary padding, a temperature, a subset of rows, several chunks, bf16 logits, one output left out
of the loss, a keep mask, and the vocabulary split over two ranks of a real gloo group; as the fsdp trainer calls
it (whole `[..., V]` blocks) and as the Megatron trainer does (rows of a vocab-parallel block)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime.algorithm import log_probs as lp_module
from slime.algorithm.log_probs import log_probs_and_entropy
from tests.forkserver import fork_context

T, V, REAL = 12, 40, 37  # logits rows, padded vocabulary, real vocabulary (Megatron pads at the end)


def reference(logits, rows, targets, temperature, keep=None):
    x = logits[rows, :REAL].to(torch.float64) / temperature
    log_p = torch.log_softmax(x, dim=-1)
    lp_logits = x if keep is None else x.masked_fill(~keep[rows, :REAL], float("-inf"))
    lp = torch.log_softmax(lp_logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, -(log_p.exp() * log_p).sum(-1)


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(T, V, generator=g)).to(dtype)
    rows = torch.tensor([1, 2, 3, 5, 8, 9, 10])
    targets = torch.randint(0, REAL, (rows.numel(),), generator=g)
    weights = torch.randn(2, rows.numel(), generator=g, dtype=torch.float64)
    return logits, rows, targets, weights


def keep_mask(rows, targets):
    """A random keep mask that drops some rows' targets (the kernel keeps them anyway); the reference's keeps them."""
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(T, V, generator=g) < 0.4
    with_targets = keep.clone()
    with_targets[rows, targets] = True
    assert not keep[rows, targets].all()
    return keep, with_targets


def grads(fn, logits, weights):
    x = logits.detach().clone().requires_grad_()
    lp, ent = fn(x)
    (lp.double() @ weights[0] + ent.double() @ weights[1]).backward()
    return lp.detach().double(), ent.detach().double(), x.grad.double()


# ---- rows of a vocab-parallel block (the Megatron trainer's call) ---------------------------------------------
# the gradient comes back in the logits' dtype: bf16 rounds it (2^-8 relative)
@pytest.mark.parametrize("dtype,tol,grad_tol", [(torch.float64, 1e-10, 1e-10), (torch.float32, 1e-5, 1e-5),
                                                (torch.bfloat16, 1e-5, 2**-8)])
def test_rows_equal_plain_autograd_in_several_chunks(monkeypatch, dtype, tol, grad_tol):
    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", 3 * REAL)  # 3 rows per chunk
    logits, rows, targets, weights = inputs(dtype)
    ours = grads(lambda x: log_probs_and_entropy(x, targets, temperature=0.7, with_entropy=True, rows=rows,
                                                 vocab_size=REAL), logits, weights)
    # the reference sees the same (rounded) logits, in fp64
    want = grads(lambda x: reference(x, rows, targets, 0.7), logits.double(), weights)
    for a, b, name, t in zip(ours, want, ("log-probs", "entropy", "gradient"), (tol, tol, grad_tol)):
        assert (a - b).abs().max() < t * max(1.0, b.abs().max()), name
    assert ours[2][:, REAL:].abs().max() == 0 and ours[2][[0, 4, 6, 7, 11]].abs().max() == 0  # unread: no grad


def test_rows_without_entropy_and_an_unused_output():
    logits, rows, targets, weights = inputs(torch.float32)
    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(x, targets, rows=rows, vocab_size=REAL)
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
    result = {}
    result["lp"], result["ent"], result["grad"] = grads(
        lambda x: log_probs_and_entropy(x, targets, temperature=0.7, with_entropy=True, rows=rows, vocab_size=REAL,
                                        group=dist.group.WORLD), part, weights)
    keep, _ = keep_mask(rows, targets)
    result["keep_lp"], result["keep_ent"], result["keep_grad"] = grads(
        lambda x: log_probs_and_entropy(x, targets, temperature=0.7, with_entropy=True, rows=rows, vocab_size=REAL,
                                        group=dist.group.WORLD, keep_mask=keep[:, rank * local:(rank + 1) * local]),
        part, weights)
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def test_vocabulary_split_over_two_ranks(tmp_path):
    fork_context(__name__)  # tests/forkserver.py: the ranks fork from a server that imported torch once
    mp.start_processes(_rank, args=(f"file://{tmp_path / 'init'}", str(tmp_path / "out")), nprocs=2, join=True,
                       start_method="forkserver")
    logits, rows, targets, weights = inputs(torch.float32)
    want = grads(lambda x: reference(x, rows, targets, 0.7), logits.double(), weights)
    _, kept = keep_mask(rows, targets)
    want_keep = grads(lambda x: reference(x, rows, targets, 0.7, kept), logits.double(), weights)
    got = [torch.load(f"{tmp_path / 'out'}.{r}") for r in range(2)]
    for prefix, expected in (("", want), ("keep_", want_keep)):
        for r in got:  # both ranks return the whole distribution's log-probs and entropy
            assert (r[f"{prefix}lp"] - expected[0]).abs().max() < 1e-5, prefix
            assert (r[f"{prefix}ent"] - expected[1]).abs().max() < 1e-5, prefix
        grad = torch.cat([got[0][f"{prefix}grad"], got[1][f"{prefix}grad"]], dim=1)  # each rank's own slice's
        assert (grad - expected[2]).abs().max() < 1e-5, prefix
    assert os.path.exists(f"{tmp_path / 'out'}.1")


@pytest.mark.parametrize("chunk_rows", [2, None])
def test_keep_mask_restricts_the_log_probs_distribution_only(chunk_rows):
    logits, rows, targets, weights = inputs(torch.float64)
    keep, kept = keep_mask(rows, targets)
    ours = grads(lambda x: log_probs_and_entropy(x, targets, temperature=0.7, with_entropy=True, rows=rows,
                                                 vocab_size=REAL, keep_mask=keep, chunk_rows=chunk_rows),
                 logits, weights)
    want = grads(lambda x: reference(x, rows, targets, 0.7, kept), logits, weights)
    for a, b, name in zip(ours, want, ("log-probs", "entropy", "gradient")):
        assert (a - b).abs().max() < 1e-10, name
    full = reference(logits, rows, targets, 0.7)[0]
    assert (ours[0] - full).abs().max() > 0.1  # the restriction did change the log-probs


def test_entropy_without_gradient_is_a_metric_only():
    logits, rows, targets, _ = inputs(torch.float32)
    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(x, targets, with_entropy=True, rows=rows, vocab_size=REAL, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    assert (ent.double() - reference(logits, rows, targets, 1.0)[1]).abs().max() < 1e-5


# ---- whole [..., V] blocks (the fsdp trainer's call) ----------------------------------------------------------
def plain(logits, targets, temperature):
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])  # several chunks, uneven, one
def test_values_and_gradients_equal_the_plain_formula(temperature, chunk_rows, monkeypatch):
    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", chunk_rows * 50)
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 50)).requires_grad_()
    targets = torch.randint(0, 50, (2, 5))
    g_lp, g_ent = torch.randn(2, 5), torch.randn(2, 5)

    lp, ent = log_probs_and_entropy(logits, targets, temperature=temperature, with_entropy=True)
    (lp * g_lp + ent * g_ent).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref_lp, ref_ent = plain(logits, targets, temperature)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()

    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert torch.allclose(ours, logits.grad, atol=1e-5)


@pytest.mark.parametrize("used", ["log_probs", "entropy"])
def test_one_output_outside_the_loss_gets_its_exact_gradient(used):
    """With --entropy-coef 0 the entropy is computed but not differentiated (and vice versa): the other
    output's gradient alone, the unused one's term skipped."""
    torch.manual_seed(3)
    logits = (2 * torch.randn(7, 30)).requires_grad_()
    targets = torch.randint(0, 30, (7,))
    lp, ent = log_probs_and_entropy(logits, targets, temperature=0.8, with_entropy=True)
    (lp if used == "log_probs" else ent).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref_lp, ref_ent = plain(logits, targets, 0.8)
    (ref_lp if used == "log_probs" else ref_ent).sum().backward()
    assert torch.allclose(ours, logits.grad, atol=1e-5)


def test_gradcheck_in_float64():
    torch.manual_seed(1)
    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (4,))
    keep = torch.rand(4, 7, generator=torch.Generator().manual_seed(2)) < 0.5
    rows = torch.tensor([0, 2, 3])
    assert torch.autograd.gradcheck(lambda x: log_probs_and_entropy(x, targets, temperature=0.9, with_entropy=True),
                                    (logits,))
    assert torch.autograd.gradcheck(lambda x: log_probs_and_entropy(x, targets)[0], (logits,))
    assert torch.autograd.gradcheck(lambda x: log_probs_and_entropy(x, targets, temperature=0.9, with_entropy=True,
                                                                    keep_mask=keep, chunk_rows=3), (logits,))
    assert torch.autograd.gradcheck(lambda x: log_probs_and_entropy(x, targets[:3], with_entropy=True, rows=rows,
                                                                    vocab_size=6), (logits,))


def test_bf16_logits_keep_their_dtype_and_match_fp32():
    torch.manual_seed(2)
    logits = torch.randn(6, 40).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 40, (6,))
    lp, ent = log_probs_and_entropy(logits, targets, with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_lp, ref_ent = plain(logits.detach().float(), targets, 1.0)
    assert torch.allclose(lp, ref_lp, atol=1e-6) and torch.allclose(ent, ref_ent, atol=1e-5)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert log_probs_and_entropy(logits, targets)[1] is None


def test_a_bad_temperature_or_shape_is_refused():
    logits, rows, targets, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match="temperature 0.0: must be > 0"):
        log_probs_and_entropy(logits, targets, temperature=0.0, rows=rows)
    with pytest.raises(ValueError, match=r"logits of shape \(1, 12, 40\) with rows"):
        log_probs_and_entropy(logits.unsqueeze(0), targets, rows=rows)
    # the whole vocabulary on this rank: a target outside it is an error (split or padded, it is another slice's)
    with pytest.raises(RuntimeError, match="index 40 is out of bounds"):
        log_probs_and_entropy(logits, torch.full((T,), V))


def test_the_one_rank_form_equals_the_two_pass_form():
    """Every row on one rank without a mask (the fsdp call) takes torch's logsumexp in one pass; reading the same
    rows by index takes the two-pass form the vocab-parallel path uses. Values and gradients agree to rounding."""
    torch.manual_seed(3)
    logits = torch.randn(37, 101, dtype=torch.float32) * 4
    targets = torch.randint(0, 101, (37,))
    g_lp, g_ent = torch.randn(37), torch.randn(37)
    out = {}
    for name, rows in (("one pass", None), ("two passes", torch.arange(37))):
        x = logits.clone().requires_grad_(True)
        lp, ent = log_probs_and_entropy(x, targets, temperature=0.7, with_entropy=True, rows=rows)
        (lp * g_lp + ent * g_ent).sum().backward()
        out[name] = (lp.detach(), ent.detach(), x.grad)
    # fp32 rounding of values near lse ~ 20: the entropy lse - E[x] cancels to ~0.1, so its error is absolute
    for a, b in zip(out["one pass"], out["two passes"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-5)
    assert not torch.equal(out["one pass"][1], out["two passes"][1])  # two forms indeed (their last bits differ)
