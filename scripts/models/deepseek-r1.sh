# DeepSeek-R1 shares DeepSeek-V3's architecture (DeepseekV3ForCausalLM, identical config.json dimensions):
# the flags are those of deepseek-v3.sh. Source it, pass ${MODEL_ARGS[@]}.
source "$(dirname "${BASH_SOURCE[0]}")/deepseek-v3.sh"
