# Architecture of the tiny Qwen3 written by `tools/make_tiny_model.py --size tiny` (~1M parameters),
# in Megatron-LM's flag names, like every scripts/models/*.sh. Source it, then pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 4
   --hidden-size 128
   --ffn-hidden-size 512
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --kv-channels 32
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 192
   --qk-layernorm
   --untie-embeddings-and-output-weights
)
