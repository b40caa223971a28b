# Llama-3-70B (Meta-Llama-3-70B[-Instruct]; for Llama-3.1 add --use-rope-scaling)
# Megatron-LM architecture flags written from the published config.json of meta-llama/Meta-Llama-3-70B (no network here: values
# from that config as published; scripts/models tests parse this file). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 80
   --hidden-size 8192
   --ffn-hidden-size 28672
   --num-attention-heads 64
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --rotary-base 500000
   --vocab-size 128256
   --untie-embeddings-and-output-weights
   --max-position-embeddings 8192
)
