"""Qwen3-VL (dense): the language model is Qwen3's layout (q/k norm, no bias) on megatron-core; the vision tower
(deepstack mergers included) keeps its HF module and names (`visual.*` on the Megatron side, vision_language.py).

Its checkpoints on the Hub spell both parts as transformers names them in memory (`model.language_model.*`,
`model.visual.*`, `lm_head.weight`), which is what export writes: transformers loads it, and SGLang's Qwen3-VL
loader maps `model.language_model.` to its `model.` and `model.visual.` to its `visual.`. Import also takes the
Qwen2.5-VL-style spelling (`model.layers.*`, `visual.*`).
"""

from __future__ import annotations

import re

from slime.backends.megatron_utils.converters.base import ConverterConfig, Tensor
from slime.backends.megatron_utils.converters.qwen2_5_vl import VISION_PREFIX, Qwen2_5VLConverter

_LANGUAGE = "model.language_model."
_VISION = "model.visual."


class Qwen3VLConverter(Qwen2_5VLConverter):
    name = "qwen3_vl"
    hf_model_types = ("qwen3_vl",)

    def megatron_to_hf(self, name: str, t: Tensor, cfg: ConverterConfig) -> list[tuple[str, Tensor]]:
        bare = re.sub(r"^(?:module\.)+", "", name)
        if bare.startswith(VISION_PREFIX):
            return [(_VISION + bare[len(VISION_PREFIX):], t)]
        return [(_LANGUAGE + n[len("model."):] if n.startswith("model.") else n, x)
                for n, x in super().megatron_to_hf(name, t, cfg)]
