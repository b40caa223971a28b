"""Images in `/generate` (`image_data`, as SGLang 0.5.16 takes it) for a vision-language model.

`load_processor_for(model_path, model)`: the model's processor when the model has a vision tower, else None.
`image_inputs(processor, images, markers, text=..., input_ids=...)` turns one prompt and its images into the prompt ids
the model sees (one `<|image_pad|>`-style token per merged image patch) and the vision tower's inputs
(`pixel_values`, `image_grid_thw`). A text prompt goes through the processor, which renders each image
placeholder to its patch count; `input_ids` are taken as already expanded (what slime's rollout sends after its
own processor call) or, with exactly one placeholder token per image, expanded here. Expanded `input_ids` may hold
several images anywhere in the sequence (a multi-turn rollout's observation images sit after earlier responses)
and image tokens the policy sampled: `slime.utils.image_tokens.stray_image_tokens` tells them apart, and the
sampled ones go to the scheduler as `vision["stray"]` (prefilled as ordinary tokens, as the trainer does).
`vision_positions(model, ids, mask, image_grid_thw)` gives the multimodal RoPE position ids of a prefill.

SGLang's shapes of `image_data`: for one prompt, an image or a list of images; for a batch of n prompts, a list
of n entries (each an image, a list of images or None), or a single image used by every prompt. An image is a
data URI (`data:image/png;base64,...`), a bare base64 string, a file path on the engine's machine or a dict
with "url". http(s) URLs are refused: the engine fetches nothing from the network.

Simplified: images only (no `video_data` / `audio_data`); the processor's default resizing.
"""

from __future__ import annotations


import torch

from slime.utils.image_tokens import expand_image_tokens, image_token_counts, stray_image_tokens, token_runs
from slime.utils.processing_utils import build_processor_kwargs, load_processor, open_image


def is_vision_model(model) -> bool:
    return getattr(model.config, "vision_config", None) is not None


def load_processor_for(model_path: str, model):
    """The processor of a vision-language model (None for a text-only one); raises when a vision model has none."""
    if not is_vision_model(model):
        return None
    processor = load_processor(model_path, trust_remote_code=True)
    if processor is None or getattr(processor, "image_processor", None) is None:
        raise ValueError(f"--model-path {model_path}: the model has a vision tower but no image processor could be "
                         "loaded from its folder (preprocessor_config.json / processor_config.json)")
    return processor


def per_prompt_images(image_data, n: int, batched: bool) -> list[list | None]:
    """`image_data` split into each prompt's list of images (None: no images), by SGLang's shapes."""
    if image_data is None:
        return [None] * n
    if not batched:
        items = image_data if isinstance(image_data, list) else [image_data]
        return [items or None]
    if not isinstance(image_data, list):
        return [[image_data] for _ in range(n)]
    if len(image_data) != n:
        raise ValueError(f"image_data has {len(image_data)} entries but the batch has {n} prompts")
    return [(entry if isinstance(entry, list) else [entry]) if entry is not None else None for entry in image_data]


def _decode(item, i: int):
    data = item.get("url") if isinstance(item, dict) else item
    if isinstance(data, str) and data.startswith(("http://", "https://")):
        raise ValueError(f"image_data[{i}]: the hf engine fetches no URLs; send the image as a data URI or base64")
    try:
        return open_image(data).convert("RGB")
    except Exception as e:  # noqa: BLE001 -- any unreadable image is the client's error, answered as 400
        raise ValueError(f"image_data[{i}]: not a readable image ({type(e).__name__}: {e})") from None


def image_inputs(processor, items: list, markers: tuple[int, int], *, text: str | None = None,
                 input_ids: list[int] | None = None):
    """(prompt ids with expanded image tokens, {"pixel_values", "image_grid_thw", "stray"}) for one prompt;
    `stray`: positions of image tokens that hold no image (sampled by the policy). `markers`: the model's vision
    start and end token ids, which bound an image's tokens in expanded `input_ids`."""
    images = [_decode(item, i) for i, item in enumerate(items)]
    pad = processor.image_token_id
    if text is not None:
        placeholders = token_runs(processor.tokenizer(text)["input_ids"], pad)
        if len(placeholders) != len(images):
            raise ValueError(f"the text has {len(placeholders)} image placeholder(s) ({processor.image_token}) for "
                             f"{len(images)} image(s) in image_data; put one in the prompt per image")
        out = processor(text=text, **build_processor_kwargs({"images": images}))
        ids = list(out["input_ids"][0])
        return ids, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"], "stray": []}
    out = processor.image_processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]
    merge = processor.image_processor.merge_size
    per_image = image_token_counts(grid, merge)
    runs = [n for _, n in token_runs(input_ids, pad)]
    stray: list[int] = []
    if runs == [1] * len(images) and runs != per_image:
        ids = expand_image_tokens(input_ids, pad, per_image)
    else:
        ids = list(input_ids)
        try:
            stray = stray_image_tokens(ids, pad, per_image, *markers)
        except ValueError as e:
            raise ValueError(f"input_ids with {len(images)} image(s) in image_data: {e}; or send one image token "
                             "per image to have them expanded here") from None
    return ids, {"pixel_values": out["pixel_values"], "image_grid_thw": grid, "stray": stray}


def vision_markers(model) -> tuple[int, int]:
    """The model's vision start and end token ids (they bound each image's run of image tokens)."""
    return model.config.vision_start_token_id, model.config.vision_end_token_id


def vision_positions(model, ids: torch.Tensor, mask: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Multimodal RoPE position ids [3, B, L] of a left-padded prefill (image tokens by temporal/row/column, text
    after an image continuing from its largest position). `ids` hold a stand-in id at sampled image tokens."""
    image_token = model.config.image_token_id
    return model.model.get_rope_index(ids, mm_token_type_ids=(ids == image_token).int(),
                                      image_grid_thw=image_grid_thw, attention_mask=mask)[0]
