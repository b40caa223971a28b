"""slime.utils.processing_utils (media -> chat content, images for processor and engine), multimodal rows in
Dataset, and slime.utils.async_utils (the background loop plugins run coroutines on)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest
from PIL import Image

from slime.utils import async_utils, http_utils
from slime.utils.data import Dataset
from slime.utils.processing_utils import (
    build_multimodal_messages,
    build_processor_kwargs,
    encode_image_for_rollout_engine,
    load_processor,
    process_vision_info,
)


def _png_b64(color) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), color).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_placeholders_take_the_rows_media_in_order():
    messages = [{"role": "user", "content": "compare <image> and <image>, then <video>"}]
    row = {"imgs": ["a.png", {"type": "image", "image": "b.png", "max_pixels": 64}], "vid": "c.mp4"}
    out = build_multimodal_messages(messages, row, {"image": "imgs", "video": "vid"})
    assert out[0]["content"] == [
        {"type": "text", "text": "compare "}, {"type": "image", "image": "a.png"}, {"type": "text", "text": " and "},
        {"type": "image", "image": "b.png", "max_pixels": 64}, {"type": "text", "text": ", then "},
        {"type": "video", "video": "c.mp4"},
    ]  # fmt: skip
    assert messages[0]["content"].startswith("compare")  # the input is not changed
    with pytest.raises(ValueError, match="more '<image>' placeholders in the prompt than image items"):
        build_multimodal_messages([{"role": "user", "content": "<image><image>"}], {"imgs": ["a"]}, {"image": "imgs"})
    with pytest.raises(ValueError, match=r"more media than placeholders .*\{'image': 1\}"):
        build_multimodal_messages([{"role": "user", "content": "none"}], {"imgs": ["a"]}, {"image": "imgs"})
    with pytest.raises(ValueError, match="unknown media type 'picture'"):
        build_multimodal_messages(messages, row, {"picture": "imgs"})


def test_images_are_read_for_the_processor_and_encoded_for_the_engine(tmp_path):
    red, blue = _png_b64((255, 0, 0)), _png_b64((0, 0, 255))
    Image.new("RGB", (2, 2), (0, 255, 0)).save(tmp_path / "g.png")
    prompt = [{"role": "user", "content": [
        {"type": "image", "image": "data:image/png;base64," + red}, {"type": "image", "image": blue},
        {"type": "image", "image": str(tmp_path / "g.png")}, {"type": "text", "text": "what colours?"}]}]  # fmt: skip
    media = process_vision_info(prompt, processor=None)
    assert [im.getpixel((0, 0)) for im in media["images"]] == [(255, 0, 0), (0, 0, 255), (0, 255, 0)]
    assert media["videos"] is None
    assert process_vision_info("a plain prompt", processor=None) == {"images": None, "videos": None}

    uri = encode_image_for_rollout_engine(Image.new("L", (1, 1), 128))  # grey, single channel
    assert uri.startswith("data:image/png;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).getpixel((0, 0)) == (128, 128, 128)

    kwargs = build_processor_kwargs({"images": ["x"], "images_kwargs": {"max_pixels": 4}})
    assert kwargs["images"] == ["x"] and kwargs["images_kwargs"] == {"max_pixels": 4, "return_tensors": "pt"}
    assert kwargs["text_kwargs"]["return_tensors"] is None and kwargs["videos_kwargs"] == {"return_tensors": "pt"}


def test_text_only_model_has_no_processor(tokenizer_dir):
    assert load_processor(tokenizer_dir) is None


def test_dataset_builds_multimodal_prompts(tmp_path):
    rows = [{"text": "what is in <image>?", "pics": [_png_b64((9, 9, 9))], "label": "grey"},
            {"text": "no picture here", "label": "none"}]  # fmt: skip
    path = tmp_path / "mm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = Dataset(str(path), None, None, None, label_key="label", multimodal_keys={"image": "pics"})
    assert plain[0].prompt[0]["content"][1] == {"type": "image", "image": rows[0]["pics"][0]}
    assert plain[1].prompt == [{"role": "user", "content": "no picture here"}]  # a row without media: as it was
    assert plain[0].multimodal_inputs is None  # no processor: the media stay in the messages only

    with_processor = Dataset(str(path), None, object(), None, label_key="label", multimodal_keys='{"image": "pics"}')
    assert with_processor[0].multimodal_inputs["images"][0].getpixel((0, 0)) == (9, 9, 9)
    assert with_processor[1].multimodal_inputs == {"images": None, "videos": None}

    path.write_text(json.dumps({"text": "<image> and <image>", "pics": ["x"]}) + "\n")
    with pytest.raises(ValueError, match=r"mm\.jsonl:1: 'text' with --multimodal-keys .*more '<image>' placeholders"):
        Dataset(str(path), None, None, None, multimodal_keys={"image": "pics"})


def test_async_run_shares_the_rollout_loop():
    async def where():
        return asyncio.get_running_loop()

    loop = async_utils.run(where())
    assert loop is http_utils.run_sync(where()) is async_utils.get_async_loop().loop

    async def fails():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        async_utils.run(fails())

    async def nested():
        return async_utils.run(where())

    with pytest.raises(RuntimeError, match="await the coroutine instead"):
        async_utils.run(nested())
