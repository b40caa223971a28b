# Qwen3-4B
# Megatron-LM architecture flags written from the published config.json of Qwen/Qwen3-4B (no network here: values
# from that config as published; scripts/models tests parse this file). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2560
   --ffn-hidden-size 9728
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 151936
   --qk-layernorm
   --max-position-embeddings 40960
)
