"""The gradient norm of megatron-core's optimizer without a host wait per parameter.

Without TransformerEngine and Apex (our GPU machines have neither), megatron-core's `get_grad_norm_fp32` calls its
local fallback `local_multi_tensor_l2_norm`, which takes each gradient's norm on the GPU and then builds a host
tensor of them (`torch.tensor(list of GPU scalars)`: one device-to-host copy and wait per parameter, ~310 for a
Qwen3-0.6B every optimizer step) and copies the result back. `install()` replaces that fallback (once per process,
only where megatron-core uses it) with `foreach_l2_norm`: `torch._foreach_norm` over the gradients and the norm of
those norms, on the device. megatron-core then waits once, for the total (`.item()` after its all-reduce), as it
does with Apex's kernel. The same value to fp32 rounding.
"""

from __future__ import annotations

import torch


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron-core's `local_multi_tensor_l2_norm` (and Apex's `multi_tensor_l2norm` without
    per-tensor norms): ([1] fp32 L2 norm of every tensor of `tensor_lists`, None), computed on their device."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def install() -> bool:
    """Use `foreach_l2_norm` where megatron-core's gradient clipping would use its local fallback; False (nothing
    changed) where it uses TransformerEngine's or Apex's kernel."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is foreach_l2_norm:
        return True
    if clip_grads.l2_norm_impl is not getattr(utils, "local_multi_tensor_l2_norm", None):
        return False
    clip_grads.l2_norm_impl = foreach_l2_norm
    return True
