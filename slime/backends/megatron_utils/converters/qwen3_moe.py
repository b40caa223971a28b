"""Qwen3-MoE: Qwen3 attention (q/k norm); MoE layers with a softmax router `mlp.gate` and per-expert
`mlp.experts.{e}.{gate,up,down}_proj`; no shared experts; dense layers where `mlp_only_layers` /
`decoder_sparse_step` say so."""

from slime.backends.megatron_utils.converters.base import GPTConverter


class Qwen3MoeConverter(GPTConverter):
    name = "qwen3_moe"
    hf_model_types = ("qwen3_moe",)
