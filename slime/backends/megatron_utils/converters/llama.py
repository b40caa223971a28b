"""Llama 2/3 (and Mistral): GQA + SwiGLU, no biases, no q/k norm; same names as Qwen."""

from slime.backends.megatron_utils.converters.base import GPTConverter


class LlamaConverter(GPTConverter):
    name = "llama"
    hf_model_types = ("llama", "mistral")
