"""Qwen2 / Qwen2.5 (QKV bias) and Qwen3 (q/k norm, no bias): the plain GQA + SwiGLU layout."""

from slime.backends.megatron_utils.converters.base import GPTConverter


class QwenConverter(GPTConverter):
    name = "qwen"
    hf_model_types = ("qwen2", "qwen3")
