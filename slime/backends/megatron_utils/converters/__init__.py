"""HF <-> Megatron converters, one per model family, looked up by HF `model_type` (or a family name).

    conv = get_converter("qwen3")                       # or converter_for_hf_config(config_dict)
    cfg = ConverterConfig.from_hf_config(config_dict, padded_vocab_size=...)
    mg = conv.hf_to_megatron(hf_state_dict, cfg)        # whole state dict (checkpoint loading)
    pairs = conv.megatron_to_hf(name, full_tensor, cfg)  # one parameter (weight sync)

`tp.py` holds the tensor-parallel shard/gather helpers for the same names.
"""

from __future__ import annotations

from slime.backends.megatron_utils.converters.base import ConverterConfig, GPTConverter
from slime.backends.megatron_utils.converters.deepseek_v3 import DeepseekV3Converter
from slime.backends.megatron_utils.converters.glm4 import Glm4Converter
from slime.backends.megatron_utils.converters.glm4_moe import Glm4MoeConverter
from slime.backends.megatron_utils.converters.llama import LlamaConverter
from slime.backends.megatron_utils.converters.qwen import QwenConverter
from slime.backends.megatron_utils.converters.qwen2_5_vl import Qwen2_5VLConverter
from slime.backends.megatron_utils.converters.qwen3_moe import Qwen3MoeConverter
from slime.backends.megatron_utils.converters.qwen3_vl import Qwen3VLConverter

FAMILIES: tuple[type[GPTConverter], ...] = (
    QwenConverter,
    Qwen2_5VLConverter,
    Qwen3VLConverter,
    LlamaConverter,
    Qwen3MoeConverter,
    Glm4Converter,
    Glm4MoeConverter,
    DeepseekV3Converter,
)

# HF model_type (and family names, for --model-name style lookups) -> converter class
REGISTRY: dict[str, type[GPTConverter]] = {}
for _family in FAMILIES:
    REGISTRY[_family.name] = _family
    for _model_type in _family.hf_model_types:
        REGISTRY[_model_type] = _family
REGISTRY.update({"qwen2.5": QwenConverter, "moonlight": DeepseekV3Converter, "kimi-k2": DeepseekV3Converter})


def get_converter(model_type: str) -> GPTConverter:
    key = model_type.lower()
    if key not in REGISTRY:
        raise KeyError(f"no HF<->Megatron converter for model type {model_type!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[key]()


def converter_for_hf_config(config: dict, model_name: str | None = None) -> GPTConverter:
    """The converter `--model-name` names (slime's key for the family's weight conversion), else the one of
    config.json's model_type."""
    if model_name:
        return get_converter(model_name)
    if "model_type" not in config:
        raise KeyError("config.json has no model_type; cannot pick a converter (name the family with --model-name)")
    return get_converter(config["model_type"])


__all__ = ["FAMILIES", "REGISTRY", "ConverterConfig", "GPTConverter", "converter_for_hf_config", "get_converter"]
