"""GLM-4 dense (GLM-4-9B-0414, `Glm4ForCausalLM`).

HF naming checked against transformers' Glm4 model: QKV with bias, the MLP stored fused as
`mlp.gate_up_proj.weight` ([gate; up], the same row order as Megatron's `linear_fc1`, so it is copied as
is), and two extra "sandwich" norms per layer, `post_self_attn_layernorm` (after attention, before the
residual add) and `post_mlp_layernorm` (after the MLP). megatron-core has no such norms; slime adds them
to its GLM-4 layer spec under the same names (`decoder.layers.N.post_self_attn_layernorm.weight`,
`decoder.layers.N.post_mlp_layernorm.weight`), which is what this converter uses.
"""

from slime.backends.megatron_utils.converters.base import GPTConverter


class Glm4Converter(GPTConverter):
    name = "glm4"
    hf_model_types = ("glm4",)
    hf_fused_gate_up = True
    post_norms = True
