"""The processors of the tiny vision-language models written by tools/make_tiny_model.py (this file is copied into
each model folder and loaded by `AutoProcessor.from_pretrained(folder, trust_remote_code=True)` through the
folder's `auto_map`, which names the arch's class: TinyQwen2_5_VLProcessor or TinyQwen3VLProcessor).

Each is transformers' processor of its arch (Qwen2_5_VLProcessor, Qwen3VLProcessor) with no video processor:
transformers builds their video processors only with torchvision installed, and the processors' constructors refuse
a missing one even for image-only use. Images go through the PIL Qwen2-VL image processor saved in the folder
(preprocessor_config.json, with the arch's patch size); `<|image_pad|>` expansion, tokenizing and outputs are the
parent's, except that `pixel_values` and `image_grid_thw` are torch tensors even when no `return_tensors` is asked
for, as the real checkpoints' (torchvision) image processors return them: plugins such as slime's multi-turn VLM
rollout call `processor(text=..., images=...)` bare and keep only tensor outputs.
"""

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2_5_VLProcessor, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


class TinyProcessorMixin:
    """Mixed in before the arch's processor class: no video processor, tensor outputs, built from the folder."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        if argument_name == "tokenizer":
            # the parent resolves every tokenizer backend transformers names, MistralCommonBackend included, which
            # fails to import where mistral-common's pydantic-extra-types is missing (SGLang's site on the H200)
            if not isinstance(argument, PreTrainedTokenizerBase):
                raise TypeError(f"Received a {type(argument).__name__} for argument tokenizer, but a tokenizer was "
                                "expected.")
            return PreTrainedTokenizerBase
        return super().check_argument_for_proper_class(argument_name, argument)

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        for key in ("pixel_values", "image_grid_thw"):
            if isinstance(out.get(key), np.ndarray):
                out[key] = torch.from_numpy(out[key])
        return out

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in ("trust_remote_code", "local_files_only", "revision")}
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        images = Qwen2VLImageProcessorPil.from_pretrained(pretrained_model_name_or_path)
        return cls(image_processor=images, tokenizer=tokenizer, video_processor=None,
                   chat_template=tokenizer.chat_template)


class TinyQwen2_5_VLProcessor(TinyProcessorMixin, Qwen2_5_VLProcessor):
    pass


class TinyQwen3VLProcessor(TinyProcessorMixin, Qwen3VLProcessor):
    pass
