# Architecture of the tiny DeepSeek-V3 (MLA + MoE) written by `tools/make_tiny_model.py --arch deepseek_v3 --size tiny`, in Megatron-LM's
# flag names (tests cross-check it against a freshly made model's config.json). Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 4
   --hidden-size 128
   --ffn-hidden-size 512
   --num-attention-heads 4
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 192
   --untie-embeddings-and-output-weights
   --position-embedding-type rope
   --no-rope-fusion
   --multi-latent-attention
   --q-lora-rank 64
   --kv-lora-rank 32
   --qk-head-dim 16
   --qk-pos-emb-head-dim 8
   --v-head-dim 16
   --qk-layernorm
   --rope-type rope
   --num-experts 4
   --moe-ffn-hidden-size 64
   --moe-router-topk 2
   --moe-layer-freq "[0,1,1,1]"
   --moe-shared-expert-intermediate-size 64
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
)
