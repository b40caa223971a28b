# GLM-Z1-9B-0414 (the reasoning model of the GLM-4-0414 family) shares GLM-4-9B-0414's architecture
# (Glm4ForCausalLM, same config.json dimensions): the flags are those of glm4-9B.sh. Source it, pass ${MODEL_ARGS[@]}.
source "$(dirname "${BASH_SOURCE[0]}")/glm4-9B.sh"
