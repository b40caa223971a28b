"""The /generate request of a sample with images (slime/rollout/generation.py): the prompt goes as text with one
placeholder per image plus `image_data` as PNG data URLs, the shape SGLang 0.5.16 expands with its own processor
(it decodes `input_ids` to text and runs the processor on that, so ids holding the expanded image tokens would be
expanded twice). What the server makes of that text must be the ids the sample trains on."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from slime.rollout.generation import (
    check_prompt_tokens,
    generate_payload,
    image_prompt_ids,
    request_prompt_text,
)
from slime.utils.processing_utils import build_processor_kwargs, encode_image_for_rollout_engine, load_processor
from slime.utils.types import Sample
from tests.args import make_args
from tools.make_tiny_model import make_tiny_model

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "vlm"), arch="qwen2_5_vl", size="tiny", seed=0)


def image_sample(images, index=0):
    content = [{"type": "image", "image": img} for img in images] + [{"type": "text", "text": "which colour?"}]
    return Sample(index=index, prompt=[{"role": "user", "content": content}], multimodal_inputs={"images": images})


def test_data_url_is_png_of_the_rgb_pixels():
    rgba = Image.new("RGBA", (30, 20), (10, 200, 30, 128))
    url = encode_image_for_rollout_engine(rgba)
    assert url.startswith("data:image/png;base64,")
    back = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert back.format == "PNG" and back.mode == "RGB" and back.size == (30, 20)
    assert back.getpixel((3, 4)) == (10, 200, 30)  # the alpha channel dropped, the colour kept


def test_payload_sends_text_instead_of_ids_with_the_images():
    urls = ["data:image/png;base64,AAAA", "data:image/png;base64,BBBB"]
    body = generate_payload([1, 2, 3], {"max_new_tokens": 2}, urls, text=f"a {PLACEHOLDER} b {PLACEHOLDER}")
    assert body == {"text": f"a {PLACEHOLDER} b {PLACEHOLDER}", "sampling_params": {"max_new_tokens": 2},
                    "return_logprob": True, "image_data": urls}
    # without text: the ids (a continued sample with images, or a text sample without image_data)
    assert generate_payload([1, 2], {}, urls) == {"input_ids": [1, 2], "sampling_params": {},
                                                  "return_logprob": True, "image_data": urls}
    assert "image_data" not in generate_payload([1, 2], {}, [])


def test_request_text_has_one_placeholder_per_image_and_makes_the_trained_ids(vlm):
    args = make_args(hf_checkpoint=vlm)
    images = [Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (28, 84), (0, 0, 255))]
    sample = image_sample(images)
    text = request_prompt_text(args, sample)
    assert text.count(PLACEHOLDER) == 2 and text.count("<|image_pad|>") == 2
    ids = image_prompt_ids(args, sample)
    processor = load_processor(vlm, trust_remote_code=True)
    # the server's processor on the request's text and images makes the ids the sample trains on
    assert processor(text=text, **build_processor_kwargs({"images": images}))["input_ids"][0] == ids
    assert ids.count(processor.image_token_id) == 4 + 3  # 2x2 and 1x3 merged patches: expanded here, not in text


def test_no_text_for_a_text_sample_or_a_continued_one(vlm):
    args = make_args(hf_checkpoint=vlm)
    assert request_prompt_text(args, Sample(index=0, prompt="what comes after one ?")) is None
    continued = image_sample([Image.new("RGB", (56, 56), (0, 255, 0))])
    continued.tokens = image_prompt_ids(args, continued) + [5]
    continued.response_length = 1
    assert request_prompt_text(args, continued) is None


def test_prompt_token_count_of_the_server_must_match():
    check_prompt_tokens("http://r/generate", {"meta_info": {"prompt_tokens": 12}}, 12)
    check_prompt_tokens("http://r/generate", {"meta_info": {}}, 12)  # a server that does not say: nothing to check
    with pytest.raises(ValueError, match="the server made 15 prompt tokens of the prompt with images, "
                                         "--hf-checkpoint's processor made 12"):
        check_prompt_tokens("http://r/generate", {"meta_info": {"prompt_tokens": 15}}, 12)
