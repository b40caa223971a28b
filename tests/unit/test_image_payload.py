"""The /generate request of a sample with images (slime/rollout/generation.py): the prompt goes as text with one
placeholder per image plus `image_data` as PNG data URLs, the shape SGLang 0.5.16 expands with its own processor; a
sample continued after a response goes as its ids with each image's run of image tokens cut to one, which SGLang
0.5.16 keeps as sent and expands image by image (`SGLANG_MM_AVOID_RETOKENIZE`, read in its
multimodal/processors/base_processor.py), as the hf engine does. What the server makes of either must be the ids
the sample trains on."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from slime.rollout.generation import (
    check_prompt_tokens,
    complete_generate_body,
    generate_payload,
    image_prompt_ids,
    image_request,
    set_engine_adapter,
)
from slime.utils.image_tokens import expand_image_tokens
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
    body = generate_payload([1, 2, 3], {"max_new_tokens": 2}, urls, prompt=f"a {PLACEHOLDER} b {PLACEHOLDER}")
    assert body == {"text": f"a {PLACEHOLDER} b {PLACEHOLDER}", "sampling_params": {"max_new_tokens": 2},
                    "return_logprob": True, "image_data": urls}
    # short ids instead of the sample's (a continued sample with images)
    assert generate_payload([1, 2, 2, 3], {}, urls, prompt=[1, 2, 3]) == {
        "input_ids": [1, 2, 3], "sampling_params": {}, "return_logprob": True, "image_data": urls}
    # no prompt: the ids
    assert generate_payload([1, 2], {}, urls) == {"input_ids": [1, 2], "sampling_params": {},
                                                  "return_logprob": True, "image_data": urls}
    assert "image_data" not in generate_payload([1, 2], {}, [])


def test_request_text_has_one_placeholder_per_image_and_makes_the_trained_ids(vlm):
    args = make_args(hf_checkpoint=vlm)
    images = [Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (28, 84), (0, 0, 255))]
    sample = image_sample(images)
    data, text = image_request(args, sample)
    assert len(data) == 2 and all(d.startswith("data:image/png;base64,") for d in data)
    assert text.count(PLACEHOLDER) == 2 and text.count("<|image_pad|>") == 2
    ids = image_prompt_ids(args, sample)
    processor = load_processor(vlm, trust_remote_code=True)
    # the server's processor on the request's text and images makes the ids the sample trains on
    assert processor(text=text, **build_processor_kwargs({"images": images}))["input_ids"][0] == ids
    assert ids.count(processor.image_token_id) == 4 + 3  # 2x2 and 1x3 merged patches: expanded here, not in text


def continued_sample(args, images, response):
    sample = image_sample(images)
    sample.tokens = image_prompt_ids(args, sample) + list(response)
    sample.response_length = len(response)
    return sample


@pytest.mark.parametrize("backend", ["sglang", "hf"])
def test_a_continued_sample_goes_as_short_ids_that_expand_to_its_own(vlm, backend):
    from slime.backends.hf_engine.vision import image_inputs

    args = make_args(hf_checkpoint=vlm, rollout_backend=backend)
    processor = load_processor(vlm, trust_remote_code=True)
    pad = processor.image_token_id
    images = [Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (28, 84), (0, 0, 255))]
    sample = continued_sample(args, images, [5, 6, 7])
    data, short = image_request(args, sample)
    assert len(data) == 2 and short.count(pad) == 2 and len(short) == len(sample.tokens) - (4 + 3) + 2
    assert expand_image_tokens(short, pad, [4, 3]) == sample.tokens  # SGLang 0.5.16's expansion of such ids
    markers = (processor.tokenizer.convert_tokens_to_ids("<|vision_start|>"),
               processor.tokenizer.convert_tokens_to_ids("<|vision_end|>"))
    ids, vision = image_inputs(processor, data, markers, input_ids=short)  # the hf engine's reading of it
    assert ids == sample.tokens and vision["stray"] == []


def test_sampled_image_tokens_go_expanded_to_the_hf_engine_and_are_refused_for_sglang(vlm):
    pad = load_processor(vlm, trust_remote_code=True).image_token_id
    images = [Image.new("RGB", (56, 56), (0, 255, 0))]
    hf = make_args(hf_checkpoint=vlm, rollout_backend="hf")
    data, prompt = image_request(hf, continued_sample(hf, images, [5, pad, 7]))  # the policy sampled an image token
    assert len(data) == 1 and prompt is None  # the expanded ids, which the hf engine tells apart
    sglang = make_args(hf_checkpoint=vlm, rollout_backend="sglang")
    with pytest.raises(ValueError, match="a response holding image tokens .* the policy sampled.*--rollout-backend hf"):
        image_request(sglang, continued_sample(sglang, images, [5, pad, 7]))


def test_no_request_changes_for_a_text_sample(vlm):
    args = make_args(hf_checkpoint=vlm)
    assert image_request(args, Sample(index=0, prompt="what comes after one ?")) == ([], None)


def test_prompt_token_count_of_the_server_must_match():
    check_prompt_tokens("http://r/generate", {"meta_info": {"prompt_tokens": 12}}, 12)
    check_prompt_tokens("http://r/generate", {"meta_info": {}}, 12)  # a server that does not say: nothing to check
    with pytest.raises(ValueError, match="the server made 15 prompt tokens of the prompt with images, "
                                         "--hf-checkpoint's processor made 12"):
        check_prompt_tokens("http://r/generate", {"meta_info": {"prompt_tokens": 15}}, 12)


def test_a_plugins_expanded_ids_go_short_to_sglang_and_as_sent_to_the_hf_engine(vlm):
    """slime's geo3k_vlm_multi_turn plugin posts its sample's ids (images expanded) with image_data itself."""
    pad = load_processor(vlm, trust_remote_code=True).image_token_id
    images = [Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (28, 84), (0, 0, 255))]
    sglang = make_args(hf_checkpoint=vlm, rollout_backend="sglang")
    ids = continued_sample(sglang, images, [5, 6, 7]).tokens
    data = [encode_image_for_rollout_engine(image) for image in images]
    body = {"input_ids": ids, "image_data": data, "sampling_params": {}, "return_logprob": True}
    sent = complete_generate_body(sglang, body)
    assert sent["input_ids"].count(pad) == 2 and expand_image_tokens(sent["input_ids"], pad, [4, 3]) == ids
    assert {k: v for k, v in sent.items() if k != "input_ids"} == {k: v for k, v in body.items() if k != "input_ids"}
    assert body["input_ids"] == ids  # the plugin's body as it was
    assert complete_generate_body(sglang, sent) is sent  # short ids (our own requests) go as they are
    hf = make_args(hf_checkpoint=vlm, rollout_backend="hf")
    assert complete_generate_body(hf, body) is body  # the hf engine takes the expanded ids (and tells stray ones)
    one = {"input_ids": continued_sample(sglang, images[:1], [5, 6]).tokens, "image_data": data[0]}  # a single image
    assert complete_generate_body(sglang, one)["input_ids"].count(pad) == 1
    text = {"input_ids": [1, 2, 3], "sampling_params": {}}
    assert complete_generate_body(sglang, text) is text


def test_a_plugins_ids_with_sampled_image_tokens_are_refused_for_sglang(vlm):
    pad = load_processor(vlm, trust_remote_code=True).image_token_id
    images = [Image.new("RGB", (56, 56), (0, 255, 0))]
    sglang = make_args(hf_checkpoint=vlm, rollout_backend="sglang")
    body = {"input_ids": continued_sample(sglang, images, [5, pad, 7]).tokens,
            "image_data": [encode_image_for_rollout_engine(images[0])]}
    with pytest.raises(ValueError, match="5 image tokens .* not one run per image.*sglang.*--rollout-backend hf"):
        complete_generate_body(sglang, body)


def test_a_plugins_request_names_the_adapter_the_engines_hold():
    args = make_args(rollout_backend="sglang")
    body = {"input_ids": [1, 2], "sampling_params": {}}
    assert complete_generate_body(args, body) is body  # no adapter loaded yet
    set_engine_adapter("slime_lora")
    try:
        assert complete_generate_body(args, body) == {**body, "lora_path": "slime_lora"}
        named = {**body, "lora_path": None}  # a plugin that asks for the base model on purpose
        assert complete_generate_body(args, named) is named
        assert generate_payload([1, 2], {})["lora_path"] == "slime_lora"
    finally:
        set_engine_adapter(None)
