"""Rotary embedding of packed (THD) micro-batches in a constant number of kernels.

megatron-core's unfused THD rotary path (`rope_utils._apply_rotary_pos_emb_thd`, used without
TransformerEngine's fused kernel) splits the packed tokens per sequence; megatron-core 0.19 then rotates
each sequence separately (cos, sin, two multiplies, a cat per sequence, for queries and keys of every layer).
With many short samples per micro-batch that is tens of thousands of tiny kernels per forward: measured on
the H200 with 64 samples of 320 tokens, a Qwen3-0.6B forward took 5x longer packed than padded, all of it
CPU launch time.

`install()` replaces that function (once per process) with one that gathers each token's frequencies by its
position in its own sequence and rotates all tokens in one `_apply_rotary_pos_emb_bshd` call: the same
rotation as megatron-core's, tokens of sequence i at positions 0..len_i - 1 (or, when `freqs` covers the
whole pack, at their offset in it, as megatron-core does then). Under context parallelism (cp > 1) `t` holds
this rank's zigzag chunks of the padded row `cu_seqlens` describes (cp_layout.py), each token rotated by its
position in its sequence, as megatron-core's per-sequence CP path does. Call signatures other than the one it
was written against keep megatron-core's own function.
"""

from __future__ import annotations

import inspect
import logging

import torch

from slime.backends.megatron_utils.cp_layout import zigzag_layout
from slime.backends.megatron_utils.fused_rope import KERNELS, covered, fused_rope

logger = logging.getLogger(__name__)

# the parameters of megatron-core's function: 0.16 names the MLA pairing flag multi_latent_attention, 0.19
# mla_rotary_interleaved (keeping multi_latent_attention as a deprecated alias); the rest is common
_KNOWN = {"t", "cu_seqlens", "freqs", "rotary_interleaved", "mla_rotary_interleaved", "multi_latent_attention",
          "mscale", "cp_group"}
_REQUIRED = {"t", "cu_seqlens", "freqs", "cp_group"}
_kernel = "torch"  # --rope-kernel: the rotation's form (install's `kernel`; fused_rope.py for triton)


def token_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] position of every packed token within its own sequence."""
    cu = cu_seqlens.to(torch.long)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=cu.device) - starts


def install(kernel: str = "torch") -> bool:
    """Patch megatron-core's THD rotary function; False (and megatron-core's own) when its signature differs.
    `kernel` (--rope-kernel): torch rotates through megatron-core's `_apply_rotary_pos_emb_bshd`, triton through
    fused_rope.py where it covers the call."""
    from megatron.core.models.common.embeddings import rope_utils

    global _kernel
    if kernel not in KERNELS:
        raise ValueError(f"--rope-kernel {kernel!r}: one of {list(KERNELS)}")
    _kernel = kernel
    original = rope_utils._apply_rotary_pos_emb_thd
    if getattr(original, "_slime_packed_rope", False):
        return True
    signature = inspect.signature(original)
    if not _REQUIRED <= set(signature.parameters) <= _KNOWN:
        logger.warning("megatron-core's _apply_rotary_pos_emb_thd%s is not a signature slime knows; packed "
                       "micro-batches keep its per-sequence rotary embedding", signature)
        return False

    def apply_thd(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        cp_group = a["cp_group"]
        mla = a.get("mla_rotary_interleaved", False)
        if a.get("multi_latent_attention") is not None:
            mla = a["multi_latent_attention"]
        t, freqs = a["t"], a["freqs"]
        total = t.shape[0]
        if cp_group is not None and cp_group.size() > 1:
            # this CP rank's zigzag chunks of the padded row `cu_seqlens` describes (cp_layout.py)
            layout = zigzag_layout(tuple(a["cu_seqlens"].tolist()), cp_group.size(), cp_group.rank(), str(t.device))
            whole_pack = freqs.size(0) == layout.padded_cu[-1]
            rows = layout.local_index if whole_pack else layout.local_positions
        elif freqs.size(0) == total:  # frequencies of the whole pack: each token at its offset in the pack
            rows = None
        else:
            rows = token_positions(a["cu_seqlens"], total)
        if _kernel == "triton" and covered(t, freqs, a["rotary_interleaved"], mla):
            if rows is None:
                rows = torch.arange(total, device=t.device)
            return fused_rope(t, freqs, rows, a["mscale"])
        token_freqs = freqs if rows is None else freqs[rows]
        # (t, freqs, rotary_interleaved, MLA pairing, mscale): the same positions in 0.16 and 0.19
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), token_freqs, a["rotary_interleaved"], mla,
                                                     a["mscale"]).squeeze(1)

    apply_thd._slime_packed_rope = True
    rope_utils._apply_rotary_pos_emb_thd = apply_thd
    return True
