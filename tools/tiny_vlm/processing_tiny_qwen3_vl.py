"""The processor of the tiny Qwen3-VL written by tools/make_tiny_model.py (copied into the model folder and loaded
by `AutoProcessor.from_pretrained(folder, trust_remote_code=True)` through its `auto_map`).

It is transformers' Qwen3VLProcessor with no video processor: transformers builds Qwen3-VL's video processor only
with torchvision installed, and the processor's constructor refuses a missing one even for image-only use. Images go
through the PIL Qwen2-VL image processor saved in the folder (preprocessor_config.json, patch 16 as Qwen3-VL's);
`<|image_pad|>` expansion, tokenizing and outputs are the parent's, except that `pixel_values` and
`image_grid_thw` are torch tensors even when no `return_tensors` is asked for, as a real checkpoint's (torchvision)
image processor returns them.
"""

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


class TinyQwen3VLProcessor(Qwen3VLProcessor):
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        if argument_name == "tokenizer":
            # the parent resolves every tokenizer backend transformers names, MistralCommonBackend included, which
            # fails to import where mistral-common's pydantic-extra-types is missing
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
