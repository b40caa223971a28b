# Qwen2.5-VL-3B-Instruct's language model, in Megatron-LM's flag names, from its published config.json (the Qwen2
# layout with QKV bias, multimodal RoPE of mrope_section [16, 24, 24], tied input and output embeddings: no
# --untie-embeddings-and-output-weights). The random-init model of `tools/make_tiny_model.py --arch qwen2_5_vl
# --size qwen2.5-vl-3b` has the same shape. The vision tower is not described by flags: it is built from the
# checkpoint's vision_config. Source it, pass ${MODEL_ARGS[@]}.
MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2048
   --ffn-hidden-size 11008
   --num-attention-heads 16
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --vocab-size 151936
   --position-embedding-type mrope
   --mrope-section 16 24 24
   --max-position-embeddings 128000
)
