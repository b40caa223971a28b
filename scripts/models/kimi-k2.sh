# Kimi-K2 (DeepSeek-V3 architecture: MLA; 384 experts + 1 shared, top-8; first layer dense; YaRN x32)
# Megatron-LM architecture flags written from the published config.json of moonshotai/Kimi-K2-Instruct (no network here: values
# from that config as published; scripts/models tests parse this file). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 61
   --hidden-size 7168
   --ffn-hidden-size 18432
   --num-attention-heads 64
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --rotary-base 50000
   --no-rope-fusion
   --vocab-size 163840
   --untie-embeddings-and-output-weights
   --max-position-embeddings 131072
   # multi-latent attention
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --rope-type yarn
   --rotary-scaling-factor 32
   --original-max-position-embeddings 4096
   --beta-fast 1
   --beta-slow 1
   --mscale 1.0
   --mscale-all-dim 1.0
   # MoE
   --num-experts 384
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-layer-freq "[0]*1+[1]*60"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.827
   --moe-router-dtype fp32
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
)
