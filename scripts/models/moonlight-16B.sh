# Moonlight-16B-A3B (DeepSeek-V3 architecture: MLA without q LoRA; 64 experts + 2 shared, top-6)
# Megatron-LM architecture flags written from the published config.json of moonshotai/Moonlight-16B-A3B (no network here: values
# from that config as published; scripts/models tests parse this file). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 27
   --hidden-size 2048
   --ffn-hidden-size 11264
   --num-attention-heads 16
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --position-embedding-type rope
   --rotary-base 50000
   --no-rope-fusion
   --vocab-size 163840
   --untie-embeddings-and-output-weights
   --max-position-embeddings 8192
   # multi-latent attention (no query LoRA: a plain q projection)
   --multi-latent-attention
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --rope-type rope
   # MoE
   --num-experts 64
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 2816
   --moe-router-topk 6
   --moe-layer-freq "[0]*1+[1]*26"
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-topk-scaling-factor 2.446
   --moe-router-dtype fp32
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
)
