# Architecture of the tiny Qwen3-MoE (every layer MoE, as Qwen3-MoE releases are) written by `tools/make_tiny_model.py --arch qwen3_moe --size tiny`, in Megatron-LM's
# flag names (tests cross-check it against a freshly made model's config.json). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 4
   --hidden-size 128
   --ffn-hidden-size 512
   --num-attention-heads 4
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 192
   --untie-embeddings-and-output-weights
   --group-query-attention
   --num-query-groups 2
   --kv-channels 32
   --use-rotary-position-embeddings
   --qk-layernorm
   --num-experts 4
   --moe-ffn-hidden-size 64
   --moe-router-topk 2
)
