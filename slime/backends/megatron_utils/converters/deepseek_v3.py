"""DeepSeek-V3 / R1, Kimi-K2 and Moonlight (`DeepseekV3ForCausalLM`): multi-latent attention and MoE.

Attention (megatron-core MLASelfAttention <-> HF):
  linear_q_down_proj <-> q_a_proj, linear_q_up_proj.layer_norm_weight <-> q_a_layernorm,
  linear_q_up_proj <-> q_b_proj (or linear_q_proj <-> q_proj when q_lora_rank is null, as in Moonlight),
  linear_kv_down_proj <-> kv_a_proj_with_mqa ([kv_lora_rank; rope dim] rows in both),
  linear_kv_up_proj.layer_norm_weight <-> kv_a_layernorm, linear_kv_up_proj <-> kv_b_proj
  (per head [k_nope; v] rows in both), linear_proj <-> o_proj.
The projections are copied as they are: both lay heads out the same way. The RoPE pairing (HF's
`rope_interleave`) is an attention-kernel setting, not a weight layout. MLP: the first
`first_k_dense_replace` layers dense, the rest MoE with a sigmoid router plus `e_score_correction_bias`
and shared experts. Multi-token-prediction layers (index >= num_hidden_layers) are skipped on import.
"""

from slime.backends.megatron_utils.converters.base import GPTConverter


class DeepseekV3Converter(GPTConverter):
    name = "deepseek_v3"
    hf_model_types = ("deepseek_v3", "kimi_k2")
    mla = True
    router_bias = True
