"""LoRA adapter sizes for the memory plan: how many adapter parameters a rank holds (docs/lora.md).

An adapter on a linear of `in` inputs and `out` outputs has r × (in + out) parameters (A: r × in, B: out × r).
fsdp adapts the HF model's own linears; Megatron adapts its fused ones (`linear_qkv` = q/k/v, `linear_fc1` = gate/up:
one A for the group) and splits them under TP as their layers (column-parallel: B ÷ TP, A whole; row-parallel:
A ÷ TP, B whole). Simplified: the decoder's attention (q/k/v/o) and dense MLP linears and the LM head are counted;
MLA projections and MoE experts (which Megatron LoRA refuses) are not.
"""

from __future__ import annotations

from slime.backends.megatron_utils.lora import HF_MODULES, megatron_targets
from slime.config.plan.model_size import ModelShape
from slime.utils.lora_adapter import ALL_LINEAR, module_names


def hf_linear_shapes(s: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapted HF linear of a dense decoder layer."""
    h, q, kv, ffn = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}


def fsdp_adapter_params(args, s: ModelShape) -> int:
    """Adapter parameters of the whole model on the fsdp trainer (sharded over its ranks like every parameter)."""
    r, shapes = args.lora_rank, hf_linear_shapes(s)
    wanted, excluded = set(module_names(args.target_modules)), set(module_names(args.exclude_modules))
    chosen = (set(shapes) if ALL_LINEAR in wanted else wanted & set(shapes)) - excluded
    dense = [i for i in range(s.num_layers) if not s.moe_layers[i]]
    per_layer = sum(r * sum(shapes[name]) for name in chosen)
    total = len(dense) * per_layer
    if "lm_head" in wanted and "lm_head" not in excluded:
        total += r * (s.hidden_size + s.vocab_size)
    return total


def megatron_adapter_params_per_layer(args, s: ModelShape, tp: int) -> tuple[float, int]:
    """(on one TP rank, whole) adapter parameters of one dense decoder layer on the Megatron trainer."""
    r, shapes = args.lora_rank, hf_linear_shapes(s)
    per_rank, whole = 0.0, 0
    for linear in megatron_targets(args.target_modules, args.exclude_modules):
        parts = [shapes[name] for name in HF_MODULES[linear]]
        fan_in, out = parts[0][0], sum(o for _, o in parts)
        whole += r * (fan_in + out)
        if linear in ("linear_qkv", "linear_fc1"):  # column-parallel: B split with the rows
            per_rank += r * fan_in + r * out / tp
        else:  # row-parallel: A split with the columns
            per_rank += r * fan_in / tp + r * out
    return per_rank, whole
