# Language model of the tiny Qwen3-VL written by `tools/make_tiny_model.py --arch qwen3_vl --size tiny`, in
# Megatron-LM's flag names: the Qwen3 layout (q/k norm, no bias) with multimodal RoPE (mrope_section of its
# text_config's rope_parameters; the axes are interleaved over the frequencies, as for every Qwen3-VL, which the
# checkpoint's model type selects). The vision tower and its deepstack mergers are not described by flags: they are
# built from the checkpoint's vision_config. Source it, pass ${MODEL_ARGS[@]}.
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
   --qk-layernorm
   --position-embedding-type mrope
   --mrope-section 6 5 5
)
