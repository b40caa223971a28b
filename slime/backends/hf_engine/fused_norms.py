"""RMSNorm as one kernel in the hf engine on CUDA.

transformers' RMSNorm modules (Qwen, Llama, GLM, DeepSeek, the Qwen-VL towers) compute in fp32 op by op: a cast,
`pow`, `mean`, `add`, `rsqrt`, `mul`, a cast back and the weight's `mul`, about eight kernels each. A Qwen3 decoder
layer runs four of them (input, post-attention, q and k norms), about half of the kernels of a decode step, and a
decode step of a small model is bound by kernel count, not bandwidth (benchmarks/README.md, `decode_speed.py
--profile`). `torch.nn.functional.rms_norm` does the same in one fused kernel on CUDA (fp32 accumulation; the
weight is applied before the one rounding to the input's dtype, where transformers rounds, then multiplies: at most
one bf16 ulp apart).

`fuse_rms_norms` gives each such module a forward that calls it, after checking on a random input that the module's
own forward computes the same (so a variant such as Gemma's `1 + weight` is left as it is); an input whose dtype is
not the weight's goes to the module's own forward. On CPU the engine keeps transformers' forward (the fused op has
no CPU kernel of its own there, and CPU runs stay bit-identical).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.nn.functional as F

logger = logging.getLogger("slime.hf_engine")


def _eps(module: torch.nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _fused_forward(module: torch.nn.Module, own, eps: float, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = module.weight  # read at each call: a release/resume or a weight load may replace its storage
    if hidden_states.dtype != weight.dtype:
        return own(hidden_states)
    return F.rms_norm(hidden_states, weight.shape, weight, eps)


def _agrees(module: torch.nn.Module, own, eps: float) -> bool:
    """The module's own forward and the fused op give the same output on a random input, within a few units in the
    last place of the weight's dtype."""
    weight = module.weight
    x = torch.randn(4, weight.shape[0], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        try:
            expected = own(x)
            got = F.rms_norm(x, weight.shape, weight, eps)
        except (RuntimeError, TypeError, ValueError):
            return False
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return False
    ulp = torch.finfo(weight.dtype).eps
    return torch.allclose(got.float(), expected.float(), rtol=4 * ulp, atol=4 * ulp)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every RMSNorm of `model` that computes what `F.rms_norm` computes a forward calling it; returns how many."""
    fused = skipped = 0
    for module in model.modules():
        weight, eps = getattr(module, "weight", None), _eps(module)
        if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, torch.Tensor) or eps is None:
            continue
        if weight.dim() != 1:
            skipped += 1
            continue
        own = module.forward
        if not _agrees(module, own, eps):
            skipped += 1
            continue
        module.forward = partial(_fused_forward, module, own, eps)
        fused += 1
    logger.info("RMSNorm: %d module(s) run as one fused kernel (F.rms_norm), %d kept as they are", fused, skipped)
    return fused
