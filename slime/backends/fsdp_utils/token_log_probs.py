"""Log-probs of chosen tokens (and the entropy) from logits, without fp32 copies of the whole [N, V] block.

The plain autograd form (`log_softmax(logits.float() / t)`, then `exp` and a product for the entropy) keeps
several fp32 tensors of the logits' size alive between forward and backward: measured on CPU with bf16
logits, 12 B per logit above the logits themselves, 20 B with the entropy. `TokenLogProbs` saves only the
logits (in their own dtype) and one logsumexp per row, and works through the rows in chunks of
`CHUNK_ELEMENTS` logits, recomputing the softmax in backward:

    x = logits / t, lse = logsumexp(x), p = exp(x - lse)
    log_prob = x[target] - lse                       d/dx = onehot(target) - p
    entropy  = lse - sum(p * x)                      d/dx = -p * (x - sum(p * x))

so the logits' gradient is (g_lp · (onehot - p) - g_ent · p · (x - E_p[x])) / t, in the logits' dtype.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 26  # fp32 elements per chunk (256 MB)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A new fp32 (fp64 for fp64 input) tensor logits / temperature: never a view of the logits."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return logits.to(dtype, copy=True).div_(temperature)


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


class TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
        n, vocab = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        log_probs = torch.empty(n, dtype=dtype, device=logits.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=logits.device)
        lse_all = torch.empty(n, dtype=dtype, device=logits.device)
        step = _rows_per_chunk(vocab)
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            x = _scaled(logits[rows], temperature)
            lse = torch.logsumexp(x, dim=-1)
            lse_all[rows] = lse
            log_probs[rows] = x.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - lse
            if with_entropy:
                p = (x - lse.unsqueeze(-1)).exp_()
                entropy[rows] = lse - (p * x).sum(-1)
        ctx.save_for_backward(logits, targets, lse_all)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        # An output outside the loss (the entropy when --entropy-coef is 0) gets None, not zeros, so its
        # gradient term is skipped rather than computed as a product with zeros.
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor):
        logits, targets, lse_all = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)
        step = _rows_per_chunk(logits.shape[1])
        for start in range(0, logits.shape[0], step):
            rows = slice(start, min(logits.shape[0], start + step))
            x = _scaled(logits[rows], t)
            p = (x - lse_all[rows].unsqueeze(-1)).exp_()
            if grad_log_probs is None:
                g = torch.zeros_like(p)
            else:
                g = p.mul(-grad_log_probs[rows].unsqueeze(-1))
                g.scatter_add_(-1, targets[rows].unsqueeze(-1), grad_log_probs[rows].unsqueeze(-1))
            if ctx.with_entropy and grad_entropy is not None and grad_entropy.numel():
                mean_x = (p * x).sum(-1, keepdim=True)
                g.sub_(p.mul_(x.sub_(mean_x)).mul_(grad_entropy[rows].unsqueeze(-1)))
            grad[rows] = g.div_(t).to(grad.dtype)
        return grad, None, None, None


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log softmax(logits / temperature)[target] per row of `logits` [..., V] (targets [...]) and, with
    `with_entropy`, the entropy of the same distribution; differentiable with respect to `logits`."""
    shape = targets.shape
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long()
    log_probs, entropy = TokenLogProbs.apply(flat_logits, flat_targets, float(temperature), with_entropy)
    return log_probs.view(shape), entropy.view(shape) if with_entropy else None
