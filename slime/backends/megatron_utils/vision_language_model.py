"""megatron-core's GPTModel with the HF vision tower of a vision-language checkpoint (vision_language.py says how
the two fit together)."""

from __future__ import annotations

import functools

import torch

from slime.backends.megatron_utils.vision_language import VISION_TOWERS, VisionSpec, interleaved_mrope_freqs


def place_at(hidden: torch.Tensor, mask: torch.Tensor, features: torch.Tensor, add: bool) -> torch.Tensor:
    """`[s, b, h]` hidden states with the rows of `features` (in `[b, s]` order of the True tokens of `mask`, as
    the images are given, row by row) put at those tokens: in place of theirs (`add=False`) or added to them."""
    by_row = hidden.transpose(0, 1)
    slot = mask.to(hidden.device).unsqueeze(-1)
    if add:
        placed = by_row + torch.zeros_like(by_row).masked_scatter(slot, features.to(by_row.dtype))
    else:
        placed = by_row.masked_scatter(slot, features.to(by_row.dtype))
    return placed.transpose(0, 1).contiguous()


def place_in_part(hidden: torch.Tensor, mask: torch.Tensor, features: torch.Tensor, add: bool,
                  start: int) -> torch.Tensor:
    """`place_at` for `[s', b, h]` hidden states holding sequence positions start .. start + s' - 1 of the `[b, s]`
    `mask` (sequence parallelism: this rank's part): the features of the mask's True tokens in that part."""
    part = slice(start, start + hidden.shape[0])
    order = (torch.cumsum(mask.flatten(), 0) - 1).view_as(mask)  # each True token's index in `features`
    mine = mask[:, part]
    return place_at(hidden, mine, features[order[:, part][mine].to(features.device)], add)


@functools.cache
def vision_language_model_class() -> type:
    """`VisionLanguageModel`, defined on first use: it subclasses megatron-core's GPTModel, and slime's modules import
    megatron-core only inside the functions that build Megatron models (the configuration imports model.py, and
    runs that never build one need no megatron-core)."""
    from megatron.core.models.gpt import GPTModel

    class InterleavedMultimodalRotaryEmbedding(torch.nn.Module):
        """megatron-core's MultimodalRotaryEmbedding called the same way, with the axes interleaved over the
        frequencies (vision_language.interleaved_mrope_freqs) instead of in blocks; it reuses the replaced
        module's frequencies (a plain attribute there, not part of the state dict)."""

        def __init__(self, blocks: torch.nn.Module):
            super().__init__()
            if blocks.rotary_interleaved or blocks.seq_len_interpolation_factor is not None:
                raise ValueError("interleaved multimodal RoPE is built for rotate-half pairs without position "
                                 "interpolation (--rotary-interleaved / --rotary-seq-len-interpolation-factor "
                                 "are not Qwen3-VL's)")
            self.inv_freq = blocks.inv_freq

        def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
            return interleaved_mrope_freqs(position_ids, self.inv_freq, mrope_section)

    class VisionLanguageModel(GPTModel):
        """megatron-core's GPTModel with an HF vision tower (`visual`, on the first pipeline stage) whose features
        replace the embeddings of the image tokens, and whose deepstack features (Qwen3-VL) are added to the
        outputs of the first decoder layers at those tokens."""

        def __init__(self, config, transformer_layer_config, vision: VisionSpec, **kwargs):
            super().__init__(config, transformer_layer_config, **kwargs)
            self.image_token_id = vision.image_token_id
            if vision.mrope_interleaved and self.position_embedding_type == "mrope":
                self.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(self.rotary_pos_emb)
            # (image mask [b, s], one feature block per deepstack layer) of the forward running now, else None
            self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
            if self.pre_process:
                self.visual = VISION_TOWERS[vision.model_type]()._from_config(vision.vision_config)
                for p in self.visual.parameters():  # each rank's gradient is its part's: summed over TP
                    setattr(p, "sequence_parallel", self.config.sequence_parallel)
                layers = self.decoder.layers
                if vision.deepstack_layers > len(layers):  # argument validation refuses this layout first
                    raise ValueError(f"{vision.deepstack_layers} deepstack layers, the first pipeline chunk holds "
                                     f"{len(layers)} decoder layers")
                for k in range(vision.deepstack_layers):
                    layers[k].register_forward_hook(functools.partial(self._add_deepstack, k))

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                    pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                    image_mask: torch.Tensor | None = None, **kwargs):
            """GPTModel's forward; with `pixel_values` (the rows' images, concatenated in row order) the tokens of
            `image_mask` (default: every image token) take the vision tower's features, in order."""
            if self.pre_process and decoder_input is None and pixel_values is not None:
                decoder_input, deepstack = self.embed_with_images(input_ids, pixel_values, image_grid_thw, image_mask)
                if deepstack:
                    self._deepstack = deepstack
            elif self.pre_process and decoder_input is None and torch.is_grad_enabled():
                decoder_input = self.embed_without_images(input_ids)
            try:
                return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)
            finally:
                self._deepstack = None

        def embed_without_images(self, input_ids: torch.Tensor) -> torch.Tensor:
            """[s, b, h] token embeddings of a micro-batch without images, plus zero times the vision tower's
            parameters (the deepstack mergers' among them): each trainable tower parameter then gets its (zero)
            gradient in every micro-batch, as the tower's forward gives it in a micro-batch with images. With
            --overlap-grad-reduce megatron-core's DDP starts a bucket's reduction once every parameter in it has
            reported a gradient, as many times as in the first step; a text-only last micro-batch would otherwise
            leave the tower's buckets waiting (an assertion in finish_grad_sync)."""
            embeddings = self.embedding(input_ids=input_ids, position_ids=None)
            trained = [p for p in self.visual.parameters() if p.requires_grad]
            if not trained:
                return embeddings
            return embeddings + 0.0 * sum(p.sum() for p in trained).to(embeddings.dtype)

        def _add_deepstack(self, k: int, layer, inputs, output):
            """Forward hook of decoder layer k: its output hidden states plus the k-th deepstack features at the
            image tokens (transformers adds them after the layer, residual included). A micro-batch without images
            runs no tower and adds nothing (embed_without_images gives the tower its zero gradients)."""
            if self._deepstack is None:
                return output
            mask, features = self._deepstack
            hidden, context = output
            return self._place(hidden, mask, features[k], add=True), context

        def _place(self, hidden: torch.Tensor, mask: torch.Tensor, features: torch.Tensor, add: bool) -> torch.Tensor:
            """place_at, or with --sequence-parallel place_in_part for this rank's part of the sequence."""
            if not self.config.sequence_parallel:
                return place_at(hidden, mask, features, add)
            from megatron.core import parallel_state

            return place_in_part(hidden, mask, features, add,
                                 parallel_state.get_tensor_model_parallel_rank() * hidden.shape[0])

        def image_features(self, pixel_values: torch.Tensor,
                           image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            """[image tokens, hidden] features of the images, in order (one per 2x2-merged patch), and the tower's
            deepstack features of the same tokens (one block per deepstack layer; none for Qwen2.5-VL)."""
            out = self.visual(pixel_values.to(self.visual.dtype), grid_thw=image_grid_thw)
            # transformers < 5 returns Qwen2.5-VL's merged features themselves
            return getattr(out, "pooler_output", out), list(getattr(out, "deepstack_features", None) or [])

        def embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                              image_mask: torch.Tensor | None = None):
            """[s, b, h] decoder input: the token embeddings with the image tokens' replaced by image features; and
            (image mask, deepstack features) for the deepstack layers (None without them)."""
            if image_mask is None:
                image_mask = input_ids == self.image_token_id
            features, deepstack = self.image_features(pixel_values, image_grid_thw)
            slots = int(image_mask.sum())
            if slots != features.shape[0]:
                raise ValueError(f"{slots} image token(s) in the micro-batch but {features.shape[0]} image feature(s) "
                                 f"from image_grid_thw {image_grid_thw.tolist()}; the rows' token ids and their "
                                 "multimodal_train_inputs do not belong together")
            embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]; [s / tp, b, h] with SP
            placed = self._place(embeddings, image_mask, features, add=False)
            return placed, (image_mask, deepstack) if deepstack else None

    return VisionLanguageModel
