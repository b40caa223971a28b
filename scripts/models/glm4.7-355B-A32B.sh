# GLM-4.7: the published config.json of zai-org/GLM-4.7 has GLM-4.6's architecture and context length
# (Glm4MoeForCausalLM, 92 layers, hidden 5120, 160 experts + 1 shared, top-8, first 3 layers dense, q/k norm,
# max_position_embeddings 202752): the flags of glm4.6-355B-A32B.sh. Source it, pass ${MODEL_ARGS[@]}.
source "$(dirname "${BASH_SOURCE[0]}")/glm4.6-355B-A32B.sh"
