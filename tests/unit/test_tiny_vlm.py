"""tools/make_tiny_model.py --arch qwen2_5_vl: a real Qwen2.5-VL model folder whose processor loads offline and
whose vision tower changes what the text model sees."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from slime.utils.processing_utils import build_processor_kwargs, load_processor
from tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "vlm"), arch="qwen2_5_vl", size="tiny", seed=0)


def _messages(image):
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "which colour fills the image?"}]}]


def test_processor_loads_offline_and_expands_the_image(vlm, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    assert type(AutoProcessor.from_pretrained(vlm, trust_remote_code=True)).__name__ == "TinyQwen2_5_VLProcessor"
    processor = load_processor(vlm, trust_remote_code=True)
    image = Image.new("RGB", (100, 60), (255, 0, 0))
    text = processor.apply_chat_template(_messages(image), tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>which colour fills the image?" in text
    assert text == processor.tokenizer.apply_chat_template(_messages(image), tokenize=False,
                                                           add_generation_prompt=True)
    out = processor(text=text, **build_processor_kwargs({"images": [image]}))
    ids, grid = out["input_ids"][0], out["image_grid_thw"]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # one pad per 2x2 merged patch; the image is resized to at most 4 merged patches
    assert ids.count(pad) == int(grid.prod()) // 4 and 1 <= ids.count(pad) <= 4
    assert out["pixel_values"].shape == (int(grid.prod()), 3 * 2 * 14 * 14)
    assert "<unk>" not in processor.tokenizer.convert_ids_to_tokens(ids)
    bare = processor(text=text, images=[image])  # no return_tensors: media as tensors, as a real checkpoint's
    assert isinstance(bare["pixel_values"], torch.Tensor) and torch.equal(bare["pixel_values"], out["pixel_values"])
    assert isinstance(bare["image_grid_thw"], torch.Tensor) and bare["input_ids"][0] == ids


def test_config_is_qwen2_5_vl_and_the_image_reaches_the_logits(vlm):
    from transformers import AutoModelForImageTextToText

    with open(f"{vlm}/config.json") as f:
        config = json.load(f)
    assert config["model_type"] == "qwen2_5_vl" and config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert sum(config["text_config"]["rope_parameters"]["mrope_section"]) * 2 == 128 // 4  # head_dim / 2
    processor = load_processor(vlm, trust_remote_code=True)
    model = AutoModelForImageTextToText.from_pretrained(vlm).eval()
    last = []
    for color in [(255, 0, 0), (0, 0, 255)]:
        image = Image.new("RGB", (56, 56), color)
        text = processor.apply_chat_template(_messages(image), tokenize=False, add_generation_prompt=True)
        out = processor(text=text, **build_processor_kwargs({"images": [image]}))
        ids = torch.tensor(out["input_ids"])
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                           mm_token_type_ids=(ids == processor.image_token_id).int()).logits
        assert torch.isfinite(logits).all()
        last.append(logits[0, -1])
    assert (last[0] - last[1]).abs().max() > 1e-4  # the colour changes the next-token distribution
