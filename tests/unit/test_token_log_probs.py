"""`token_log_probs` (chunked, recomputing backward) against the plain autograd formula it replaces."""

from __future__ import annotations

import pytest
import torch

from slime.backends.fsdp_utils import token_log_probs as mod
from slime.backends.fsdp_utils.token_log_probs import TokenLogProbs, token_log_probs


def plain(logits, targets, temperature):
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])  # several chunks, uneven, one
def test_values_and_gradients_equal_the_plain_formula(temperature, chunk_rows, monkeypatch):
    monkeypatch.setattr(mod, "CHUNK_ELEMENTS", chunk_rows * 50)
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 50)).requires_grad_()
    targets = torch.randint(0, 50, (2, 5))
    g_lp, g_ent = torch.randn(2, 5), torch.randn(2, 5)

    lp, ent = token_log_probs(logits, targets, temperature, with_entropy=True)
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
    lp, ent = token_log_probs(logits, targets, 0.8, with_entropy=True)
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
    assert torch.autograd.gradcheck(lambda x: TokenLogProbs.apply(x, targets, 0.9, True), (logits,))
    assert torch.autograd.gradcheck(lambda x: TokenLogProbs.apply(x, targets, 1.0, False)[0], (logits,))


def test_bf16_logits_keep_their_dtype_and_match_fp32():
    torch.manual_seed(2)
    logits = torch.randn(6, 40).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 40, (6,))
    lp, ent = token_log_probs(logits, targets, with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_lp, ref_ent = plain(logits.detach().float(), targets, 1.0)
    assert torch.allclose(lp, ref_lp, atol=1e-6) and torch.allclose(ent, ref_ent, atol=1e-5)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert token_log_probs(logits, targets)[1] is None
