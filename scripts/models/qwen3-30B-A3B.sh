# Qwen3-30B-A3B (MoE: 128 experts, top-8, every layer MoE)
# Megatron-LM architecture flags written from the published config.json of Qwen/Qwen3-30B-A3B (no network here: values
# from that config as published; scripts/models tests parse this file). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 151936
   --qk-layernorm
   --untie-embeddings-and-output-weights
   --max-position-embeddings 40960
   # MoE
   --num-experts 128
   --moe-ffn-hidden-size 768
   --moe-router-topk 8
   --moe-router-score-function softmax
   --moe-router-load-balancing-type aux_loss
   --moe-aux-loss-coeff 1e-3
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
)
