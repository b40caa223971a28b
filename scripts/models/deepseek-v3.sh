# DeepSeek-V3 / R1 (MLA; 256 experts + 1 shared, top-8 of 8 groups pick 4; first 3 layers dense; YaRN x40)
# Megatron-LM architecture flags written from the published config.json of deepseek-ai/DeepSeek-V3 (no network here: values
# from that config as published; scripts/models tests parse this file). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 61
   --hidden-size 7168
   --ffn-hidden-size 18432
   --num-attention-heads 128
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --rotary-base 10000
   --no-rope-fusion
   --vocab-size 129280
   --untie-embeddings-and-output-weights
   --max-position-embeddings 163840
   # multi-latent attention
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --rope-type yarn
   --rotary-scaling-factor 40
   --original-max-position-embeddings 4096
   --beta-fast 32
   --beta-slow 1
   --mscale 1.0
   --mscale-all-dim 1.0
   # MoE
   --num-experts 256
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-layer-freq "[0]*3+[1]*58"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.5
   --moe-router-num-groups 8
   --moe-router-group-topk 4
   --moe-router-dtype fp32
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
)
