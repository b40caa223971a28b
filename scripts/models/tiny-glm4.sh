# Architecture of the tiny GLM-4 (dense) written by `tools/make_tiny_model.py --arch glm4 --size tiny`, in Megatron-LM's
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
   --add-qkv-bias
   --rotary-percent 0.5
   --rotary-interleaved
   --no-rope-fusion
   --post-self-attn-layernorm
   --post-mlp-layernorm
)
