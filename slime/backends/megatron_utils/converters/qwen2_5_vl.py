"""Qwen2.5-VL: the language model is Qwen2's layout (QKV bias) on megatron-core; the vision tower keeps its HF
module and names (`visual.*` on the Megatron side, vision_language.py), so its tensors pass through unchanged.

Checkpoints spell the two parts either as the Hub's files do (`model.layers.*`, `model.embed_tokens.weight`,
`model.norm.weight`, `visual.*`, `lm_head.weight`) or as transformers >= 4.52 names them in memory
(`model.language_model.*`, `model.visual.*`); both load. Export writes the Hub's spelling, which is also what
transformers and SGLang read back.
"""

from __future__ import annotations

from slime.backends.megatron_utils.converters.base import ConverterConfig, Tensor
from slime.backends.megatron_utils.converters.qwen import QwenConverter

VISION_PREFIX = "visual."  # the Megatron-side names of the vision tower's parameters
_LANGUAGE_IN_MEMORY = "model.language_model."
_VISION_IN_MEMORY = "model.visual."


def split_vision_language(hf: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """HF checkpoint tensors -> (language model tensors under the text model's names `model.*` / `lm_head.weight`,
    vision tower tensors under `visual.*`)."""
    language, vision = {}, {}
    for name, t in hf.items():
        if name.startswith(_VISION_IN_MEMORY):
            vision[VISION_PREFIX + name[len(_VISION_IN_MEMORY):]] = t
        elif name.startswith(VISION_PREFIX):
            vision[name] = t
        elif name.startswith(_LANGUAGE_IN_MEMORY):
            language["model." + name[len(_LANGUAGE_IN_MEMORY):]] = t
        else:
            language[name] = t
    return language, vision


class Qwen2_5VLConverter(QwenConverter):
    name = "qwen2_5_vl"
    hf_model_types = ("qwen2_5_vl",)

    def megatron_to_hf(self, name: str, t: Tensor, cfg: ConverterConfig) -> list[tuple[str, Tensor]]:
        if name.startswith(VISION_PREFIX):
            return [(name, t)]
        return super().megatron_to_hf(name, t, cfg)

    def hf_to_megatron(self, hf: dict[str, Tensor], cfg: ConverterConfig, spec: str = "te",
                       grouped: bool = False) -> dict[str, Tensor]:
        language, vision = split_vision_language(hf)
        return {**super().hf_to_megatron(language, cfg, spec, grouped), **vision}
