"""megatron-core's GPTModel with the HF vision tower of a vision-language checkpoint (vision_language.py says how
the two fit together)."""

from __future__ import annotations

import functools

import torch

from slime.backends.megatron_utils.vision_language import VISION_TOWERS, VisionSpec


@functools.cache
def vision_language_model_class() -> type:
    """`VisionLanguageModel`, defined on first use: it subclasses megatron-core's GPTModel, and slime's modules import
    megatron-core only inside the functions that build Megatron models (the configuration imports model.py, and
    runs that never build one need no megatron-core)."""
    from megatron.core.models.gpt import GPTModel

    class VisionLanguageModel(GPTModel):
        """megatron-core's GPTModel with an HF vision tower (`visual`, on the first pipeline stage) whose features
        replace the embeddings of the image tokens."""

        def __init__(self, config, transformer_layer_config, vision: VisionSpec, **kwargs):
            super().__init__(config, transformer_layer_config, **kwargs)
            self.image_token_id = vision.image_token_id
            if self.pre_process:
                self.visual = VISION_TOWERS[vision.model_type]()._from_config(vision.vision_config)

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                    pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                    image_mask: torch.Tensor | None = None, **kwargs):
            """GPTModel's forward; with `pixel_values` (the rows' images, concatenated in row order) the tokens of
            `image_mask` (default: every image token) take the vision tower's features, in order."""
            if self.pre_process and decoder_input is None and pixel_values is not None:
                decoder_input = self.embed_with_images(input_ids, pixel_values, image_grid_thw, image_mask)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)

        def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
            """[image tokens, hidden] features of the images, in order (one per 2x2-merged patch for Qwen2.5-VL)."""
            out = self.visual(pixel_values.to(self.visual.dtype), grid_thw=image_grid_thw)
            return getattr(out, "pooler_output", out)  # transformers < 5 returns the merged features themselves

        def embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                              image_mask: torch.Tensor | None = None) -> torch.Tensor:
            """[s, b, h] decoder input: the token embeddings with the image tokens' replaced by image features."""
            if image_mask is None:
                image_mask = input_ids == self.image_token_id
            features = self.image_features(pixel_values, image_grid_thw)
            slots = int(image_mask.sum())
            if slots != features.shape[0]:
                raise ValueError(f"{slots} image token(s) in the micro-batch but {features.shape[0]} image feature(s) "
                                 f"from image_grid_thw {image_grid_thw.tolist()}; the rows' token ids and their "
                                 "multimodal_train_inputs do not belong together")
            embeddings = self.embedding(input_ids=input_ids, position_ids=None).transpose(0, 1)  # [b, s, h]
            placed = embeddings.masked_scatter(image_mask.unsqueeze(-1), features.to(embeddings.dtype))
            return placed.transpose(0, 1).contiguous()

    return VisionLanguageModel
