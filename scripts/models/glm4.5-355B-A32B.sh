# GLM-4.5 (355B-A32B: 160 experts + 1 shared, top-8, first 3 layers dense, q/k norm)
# Megatron-LM architecture flags written from the published config.json of zai-org/GLM-4.5 (no network here: values
# from that config as published; scripts/models tests parse this file). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 92
   --hidden-size 5120
   --ffn-hidden-size 12288
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-percent 0.5
   --no-rope-fusion
   --disable-bias-linear
   --add-qkv-bias
   --qk-layernorm
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --rotary-base 1000000
   --vocab-size 151552
   --untie-embeddings-and-output-weights
   --max-position-embeddings 131072
   # MoE
   --num-experts 160
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 8
   --moe-layer-freq "[0]*3+[1]*89"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.5
   --moe-router-dtype fp32
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
)
