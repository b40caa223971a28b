# Language model of the tiny Qwen2.5-VL written by `tools/make_tiny_model.py --arch qwen2_5_vl --size tiny`, in
# Megatron-LM's flag names: the Qwen2 layout (QKV bias) with multimodal RoPE (mrope_section of its text_config's
# rope_parameters). The vision tower is not described by flags: it is built from the checkpoint's vision_config.
# Source it, pass ${MODEL_ARGS[@]}.
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
   --group-query-attention
   --num-query-groups 2
   --kv-channels 32
   --position-embedding-type mrope
   --mrope-section 4 6 6
   --add-qkv-bias
)
