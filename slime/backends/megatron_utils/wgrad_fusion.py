"""Megatron's gradient accumulation fusion without apex or TransformerEngine.

With `gradient_accumulation_fusion` (Megatron-LM's default; `--no-gradient-accumulation-fusion` turns it off)
megatron-core's linear layers add each weight gradient into the weight's fp32 `main_grad` inside the weight-gradient
GEMM, where otherwise the GEMM writes a bf16 gradient that the DDP hook then adds into `main_grad`: one more pass
over every gradient in every micro-batch, and the gradient rounded to bf16 before it is summed. The GEMM comes from
apex's `fused_weight_gradient_mlp_cuda` extension (or TransformerEngine's layers), neither of which the GPU machine
has, so megatron-core's local layers ran without it.

`install()` gives megatron-core's `tensor_parallel.layers` an accumulator of its own: `torch.addmm` with
`out_dtype=torch.float32` into `main_grad` itself (cuBLAS with beta = 1, bf16 operands, fp32 accumulation and output),
the call apex's kernel makes. `supported()` says whether this torch build does that on this GPU (checked once,
against a float reference); without CUDA the accumulator adds a plain product, which only tests use.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)


def accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad += grad_output^T @ total_input ([tokens, out] and [tokens, in] into [out, in]), in main_grad's
    dtype."""
    if main_grad.is_cuda and main_grad.dtype != total_input.dtype:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    elif main_grad.is_cuda:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        main_grad.add_(grad_output.t().mm(total_input))


@functools.cache
def supported() -> bool:
    """True when CUDA is here and `accumulate` adds a bf16 product into an fp32 buffer correctly (torch builds before
    the fp32-`self` form of `addmm(out_dtype=)` refuse it)."""
    if not torch.cuda.is_available():
        return False
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 32, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(64, 48, device="cuda", generator=g).to(torch.bfloat16)
    main_grad = torch.randn(48, 32, device="cuda", generator=g)
    want = main_grad + dy.float().t() @ x.float()
    try:
        accumulate(x, dy, main_grad)
    except RuntimeError as e:
        logger.info("gradient accumulation fusion off: this torch cannot add a bf16 product into fp32 (%s)", e)
        return False
    ok = torch.allclose(main_grad, want, rtol=1e-3, atol=1e-3)
    if not ok:
        logger.warning("gradient accumulation fusion off: torch.addmm(out_dtype=float32) gave a wrong sum here")
    return ok


def install() -> bool:
    """Make megatron-core's linear layers accept `gradient_accumulation_fusion` and use `accumulate` (once per
    process, before any layer is built: a layer checks at construction). False where megatron-core's layers module
    is not the one this was written against (its apex probe `_grad_accum_fusion_available` absent)."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_slime_wgrad_fusion", False):
        return True
    if not hasattr(layers, "_grad_accum_fusion_available"):
        logger.info("gradient accumulation fusion off: megatron-core's tensor_parallel.layers has no apex probe")
        return False
    layers.fused_weight_gradient_mlp_cuda = SimpleNamespace(wgrad_gemm_accum_fp32=accumulate,
                                                            wgrad_gemm_accum_fp16=accumulate)
    layers._grad_accum_fusion_available = True
    layers._slime_wgrad_fusion = True
    return True
