# GLM-4.6 keeps GLM-4.5's 355B-A32B architecture (Glm4MoeForCausalLM; the published config.json differs in the
# context length only): the flags are those of glm4.5-355B-A32B.sh. Source it, pass ${MODEL_ARGS[@]}.
source "$(dirname "${BASH_SOURCE[0]}")/glm4.5-355B-A32B.sh"
