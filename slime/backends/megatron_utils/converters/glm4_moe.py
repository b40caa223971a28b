"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`): GQA with QKV bias and optional q/k norm
(`use_qk_norm`), the first `first_k_dense_replace` layers dense (separate gate/up/down, unlike GLM-4
dense), then MoE layers with a sigmoid router (`mlp.gate.weight` + `mlp.gate.e_score_correction_bias`
<-> `mlp.router.weight` + `mlp.router.expert_bias`), routed experts and `mlp.shared_experts`. No sandwich
norms (those are GLM-4 dense only)."""

from slime.backends.megatron_utils.converters.base import GPTConverter


class Glm4MoeConverter(GPTConverter):
    name = "glm4_moe"
    hf_model_types = ("glm4_moe",)
    router_bias = True
