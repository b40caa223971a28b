# GLM-4-9B-0414 (QKV bias, half-dim interleaved RoPE, sandwich norms)
# Megatron-LM architecture flags written from the published config.json of THUDM/GLM-4-9B-0414 (no network here: values
# from that config as published; scripts/models tests parse this file). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 40
   --hidden-size 4096
   --ffn-hidden-size 13696
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-percent 0.5
   --rotary-interleaved
   --no-rope-fusion
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --rotary-base 10000
   --vocab-size 151552
   --post-self-attn-layernorm
   --post-mlp-layernorm
   --untie-embeddings-and-output-weights
   --max-position-embeddings 32768
)
