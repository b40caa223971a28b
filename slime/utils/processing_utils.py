"""Tokenizers, multimodal processors and media for prompts (slime's `slime.utils.processing_utils`).

What slime's plugins import from here: `load_tokenizer`, `load_processor`, `build_processor_kwargs`,
`process_vision_info`, `encode_image_for_rollout_engine`. Also the one place a data row's media become chat
content (`build_multimodal_messages`, used by `slime.utils.data`).

transformers and PIL are imported when a function needs them, so importing this module (as
`slime.utils.data` does) stays cheap for text-only runs.

Simplifications: `load_processor` relies on `AutoProcessor` (no hand-built fallback for processors older
transformers did not register); without `qwen_vl_utils` installed, `process_vision_info` reads images only
(PIL images, data URIs, base64 strings, file paths) and no videos.
"""

from __future__ import annotations

import base64
import binascii
import copy
import io
import logging
import re
from typing import Any

from slime.utils.types import MultimodalTypes

logger = logging.getLogger(__name__)

# image patch size when the processor does not say (Qwen2.5-VL uses 14, Qwen3-VL 16)
DEFAULT_PATCH_SIZE = 14


def load_tokenizer(name_or_path: str, **kwargs):
    """`AutoTokenizer.from_pretrained(name_or_path, **kwargs)`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs):
    """The multimodal processor of a model, or None for a text-only model (whose AutoProcessor is just its
    tokenizer) or when none can be loaded (logged)."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as e:
        logger.warning("no processor loaded from %s: %s", name_or_path, e)
        return None
    if isinstance(processor, PreTrainedTokenizerBase) or not isinstance(processor, ProcessorMixin):
        return None
    return processor


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """Keyword arguments for `processor(text=..., **kwargs)`: the media in `multimodal_inputs`, text outputs as
    plain lists (input_ids), media outputs as torch tensors (pixel_values, ...)."""
    kwargs = dict(multimodal_inputs) if multimodal_inputs else {}
    kwargs["text_kwargs"] = {**kwargs.get("text_kwargs", {}), "return_tensors": None, "return_mm_token_type_ids": False}
    for key in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        kwargs[key] = {**kwargs.get(key, {}), "return_tensors": "pt"}
    return kwargs


def open_image(data: Any):
    """A PIL image from a PIL image, a data URI, a base64 string or a file path."""
    from PIL import Image

    if isinstance(data, Image.Image):
        return data
    if not isinstance(data, str):
        raise ValueError(f"image content must be a PIL image, a data URI, base64 or a file path; got {type(data).__name__}")
    if data.startswith("data:"):
        return Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[1])))
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return Image.open(data)  # not base64: a file path
    return Image.open(io.BytesIO(raw))


def _images_in(messages) -> list:
    images = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        for item in content if isinstance(content, list) else []:
            if isinstance(item, dict) and item.get("type") == "image" and item.get("image") is not None:
                images.append(open_image(item["image"]))
    return images


def process_vision_info(prompt, processor) -> dict:
    """The media of a chat prompt, for the processor: {"images": [PIL images] or None, "videos": ... or None}.
    A string prompt has none. Uses qwen_vl_utils (resizing to the processor's patch size) when installed."""
    if not isinstance(prompt, list):
        return {"images": None, "videos": None}
    try:
        from qwen_vl_utils import process_vision_info as qwen_process_vision_info
    except ImportError:
        return {"images": _images_in(prompt) or None, "videos": None}
    patch_size = getattr(getattr(processor, "image_processor", None), "patch_size", None) or DEFAULT_PATCH_SIZE
    images, videos = qwen_process_vision_info(prompt, image_patch_size=patch_size)
    return {"images": images, "videos": videos}


def encode_image_for_rollout_engine(image) -> str:
    """A PIL image as the engine takes it: RGB, PNG, `data:image/png;base64,...`."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("utf-8")


def build_multimodal_messages(messages: list[dict], row: dict, multimodal_keys: dict[str, str]) -> list[dict]:
    """`messages` (a copy) with the media of `row` put in place of their placeholders.

    `multimodal_keys` maps a media type ("image", "video", "audio") to the row key holding that type's items,
    in order. Every `<image>` (`<video>`, `<audio>`) in a message's text content takes the next item; the
    content becomes a list of parts, `{"type": "text", "text": ...}` and `{"type": "image", "image": item}` (an
    item that is already a dict, e.g. with max_pixels, is kept as given). Content that is already a list of
    parts is left as it is. More placeholders than items, or items left over, is an error saying which.
    """
    media: dict[str, tuple[Any, list]] = {}
    for type_name, key in multimodal_keys.items():
        kind = MultimodalTypes.get(type_name)
        if kind is None:
            names = [m.name for m in MultimodalTypes.all()]
            raise ValueError(f"--multimodal-keys: unknown media type {type_name!r}; use one of {names}")
        if row.get(key) is not None:
            items = row[key]
            media[kind.placeholder] = (kind, list(items) if isinstance(items, (list, tuple)) else [items])
    messages = copy.deepcopy(messages)
    if not media:
        return messages
    pattern = re.compile("(" + "|".join(re.escape(p) for p in media) + ")")
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            continue
        if not isinstance(content, str):
            raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
        parts = []
        for piece in pattern.split(content):
            if not piece:
                continue
            if piece not in media:
                parts.append({"type": "text", "text": piece})
                continue
            kind, items = media[piece]
            if not items:
                raise ValueError(f"more '{piece}' placeholders in the prompt than {kind.name} items in the row")
            item = items.pop(0)
            parts.append(item if isinstance(item, dict) else {"type": kind.name, kind.name: item})
        message["content"] = parts
    left = {kind.name: len(items) for kind, items in media.values() if items}
    if left:
        raise ValueError(f"the row has more media than placeholders in the prompt (left over: {left})")
    return messages
