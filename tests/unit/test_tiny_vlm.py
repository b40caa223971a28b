"""tools/make_tiny_model.py --arch qwen2_5_vl / qwen3_vl: a real Qwen2.5-VL / Qwen3-VL model folder whose processor
loads offline and whose vision tower changes what the text model sees."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from slime.utils.processing_utils import build_processor_kwargs, load_processor
from tools.make_tiny_model import make_tiny_model


# arch: (processor class, architecture, ViT patch size)
ARCHS = {"qwen2_5_vl": ("TinyQwen2_5_VLProcessor", "Qwen2_5_VLForConditionalGeneration", 14),
         "qwen3_vl": ("TinyQwen3VLProcessor", "Qwen3VLForConditionalGeneration", 16)}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def vlm(arch, tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / arch), arch=arch, size="tiny", seed=0)


def _messages(image):
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "which colour fills the image?"}]}]


def test_processor_loads_offline_and_expands_the_image(arch, vlm, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor

    processor_class, _, patch = ARCHS[arch]
    assert type(AutoProcessor.from_pretrained(vlm, trust_remote_code=True)).__name__ == processor_class
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
    assert out["pixel_values"].shape == (int(grid.prod()), 3 * 2 * patch * patch)
    assert "<unk>" not in processor.tokenizer.convert_ids_to_tokens(ids)
    bare = processor(text=text, images=[image])  # no return_tensors: media as tensors, as a real checkpoint's
    assert isinstance(bare["pixel_values"], torch.Tensor) and torch.equal(bare["pixel_values"], out["pixel_values"])
    assert isinstance(bare["image_grid_thw"], torch.Tensor) and bare["input_ids"][0] == ids


def test_ids_decode_with_each_image_whole_as_sglang_finds_them(arch, vlm):
    """A continued sample goes to SGLang as ids with one image token per image; SGLang 0.5.16's Qwen-VL processor
    decodes them and finds the images with the regex `<|vision_start|>(?:<|image_pad|>)+<|vision_end|>`
    (multimodal/processors/qwen_vl.py), so the tokenizer must decode an image's tokens with no space inside, as
    a real Qwen tokenizer does (with one in between, SGLang found no image and answered 21 prompt tokens for 22)."""
    import re

    from slime.utils.image_tokens import collapse_image_runs

    processor = load_processor(vlm, trust_remote_code=True)
    images = [Image.new("RGB", (56, 84), (255, 0, 0)), Image.new("RGB", (28, 28), (0, 0, 255))]
    messages = [{"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "image", "image": "y"},
                                             {"type": "text", "text": "which colour fills the image?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = processor(text=text, **build_processor_kwargs({"images": images}))["input_ids"][0] + [5, 7]
    tok = processor.tokenizer.convert_tokens_to_ids
    short = collapse_image_runs(ids, processor.image_token_id, tok("<|vision_start|>"), tok("<|vision_end|>"), 2)
    sglang_image = r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>"
    for sent in (short, ids):
        decoded = processor.tokenizer.decode(sent)
        assert len(re.findall(sglang_image, decoded)) == 2, decoded
        assert processor.tokenizer(decoded)["input_ids"] == sent
    assert processor.tokenizer.decode(tok(["red", "fills", "the", "image"])) == "red fills the image"


def test_config_is_the_arch_and_the_image_reaches_the_logits(arch, vlm):
    from transformers import AutoModelForImageTextToText

    with open(f"{vlm}/config.json") as f:
        config = json.load(f)
    assert config["model_type"] == arch and config["architectures"] == [ARCHS[arch][1]]
    assert sum(config["text_config"]["rope_parameters"]["mrope_section"]) * 2 == 128 // 4  # head_dim / 2
    assert config["vision_config"]["patch_size"] == ARCHS[arch][2]
    if arch == "qwen3_vl":
        # interleaved mrope; every ViT block feeds a deepstack merger into the first text layers; q/k norm
        assert config["text_config"]["rope_parameters"]["mrope_interleaved"] is True
        assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
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
    if arch == "qwen3_vl":
        names = {n for n, _ in model.named_parameters()}
        assert "model.language_model.layers.0.self_attn.q_norm.weight" in names
        assert "model.visual.deepstack_merger_list.1.linear_fc2.weight" in names


def test_the_same_seed_writes_the_same_weights(tmp_path):
    from safetensors.torch import load_file

    a, b, c = (make_tiny_model(str(tmp_path / name), arch="qwen3_vl", size="tiny", seed=seed)
               for name, seed in [("a", 0), ("b", 0), ("c", 1)])
    wa, wb, wc = (load_file(f"{path}/model.safetensors") for path in (a, b, c))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
