# GLM-4.6 keeps GLM-4.5's 355B-A32B architecture (Glm4MoeForCausalLM); its published config.json differs in the
# context length only (max_position_embeddings 202752): the flags of glm4.5-355B-A32B.sh with that length.
# Source it, pass ${MODEL_ARGS[@]}.
source "$(dirname "${BASH_SOURCE[0]}")/glm4.5-355B-A32B.sh"
for i in "${!MODEL_ARGS[@]}"; do
   if [[ "${MODEL_ARGS[$i]}" == "--max-position-embeddings" ]]; then MODEL_ARGS[$((i + 1))]=202752; fi
done
