# GLM-4.5-Air (106B-A12B: 128 experts + 1 shared, top-8, first layer dense)
# Megatron-LM architecture flags written from the published config.json of zai-org/GLM-4.5-Air (no network here: values
# from that config as published; scripts/models tests parse this file). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 46
   --hidden-size 4096
   --ffn-hidden-size 10944
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --use-rotary-position-embeddings
   --rotary-percent 0.5
   --no-rope-fusion
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --rotary-base 1000000
   --vocab-size 151552
   --untie-embeddings-and-output-weights
   --max-position-embeddings 131072
   # MoE
   --num-experts 128
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 1408
   --moe-router-topk 8
   --moe-layer-freq "[0]*1+[1]*45"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-dtype fp32
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
)
