"""The built-in multi-turn rollout (`slime.rollout.multi_turn`) with images, against a real hf engine server process
serving the tiny Qwen2.5-VL (as tests/unit/test_multi_turn.py does for text).

`tool_loop` runs a prompt with one image for three model turns; each tool result carries a new image (of another
size, so another token count). Checked: every turn's request carries every image so far (the first as the prompt
text with one placeholder, as the single-turn rollout sends it; later turns as the ids with each image's run of
tokens cut to one, which the engine expands back to the sample's ids); the final sample's ids are the processor's expansion of the prompt followed by the turns, each
observation image a marked run at loss mask 0 inside the response; `multimodal_train_inputs` holds the prompt's and
the observations' processed images in order; and the trainer's forward (`slime.backends.fsdp_utils.data`, with its
checks of the rows' image runs) on that sample gives the rollout's log-probs at every model token. Also: text tool
results through the same path, the refusals (SGLang with image tokens the policy sampled, images on a text-only
model).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from slime.backends.fsdp_utils.data import forward_response_log_probs, micro_batch_images
from slime.backends.training.batching import make_micro_batch
from slime.rollout import multi_turn
from slime.rollout.generation import image_request, processed_image_prompt
from slime.rollout.multi_turn import Observation, render_observation, render_tool_message, tool_loop
from slime.utils.http_utils import run_sync
from slime.utils.image_tokens import image_token_counts, stray_image_tokens, token_runs
from slime.utils.processing_utils import build_processor_kwargs, encode_image_for_rollout_engine, load_processor
from slime.utils.types import Sample
from tests.args import make_args, router_fields

TOL = 1e-5
PROMPT_IMAGE = Image.new("RGB", (56, 84), (200, 30, 30))
# one observation image per tool call, each of another size: 2, 1 and 4 image tokens
OBSERVATION_IMAGES = [Image.new("RGB", (56, 28), (20, 200, 40)), Image.new("RGB", (28, 28), (10, 20, 220)),
                      Image.new("RGB", (56, 56), (240, 240, 0))]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl"), arch="qwen2_5_vl", size="tiny", seed=0)


@pytest.fixture(scope="module")
def engine(vlm):
    from slime.backends.hf_engine.engine import HFEngine

    eng = HFEngine(make_args(hf_checkpoint=vlm, rollout_seed=1, sglang_server_concurrency=8), rank=0)
    try:
        eng.init()
        yield eng.get_url()
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def processor(vlm):
    return load_processor(vlm, trust_remote_code=True)


def _args(vlm, url="http://127.0.0.1:9", **kw):
    fields = {"hf_checkpoint": vlm, **router_fields(url), "max_turns": 3, "apply_chat_template_kwargs": {}}
    fields.update(kw)
    return make_args(validate=False, **fields)


def _sample(index=0) -> Sample:
    prompt = [{"role": "user", "content": [{"type": "image", "image": "x"},
                                           {"type": "text", "text": "which colour fills the image?"}]}]
    return Sample(index=index, prompt=prompt, multimodal_inputs={"images": [PROMPT_IMAGE]})


def _processed(processor, images) -> dict:
    out = [processor.image_processor(images=[im], return_tensors="pt") for im in images]
    return {k: torch.cat([o[k] for o in out]) for k in ("pixel_values", "image_grid_thw")}


@pytest.mark.timeout(300)
def test_tool_loop_keeps_every_image_in_every_turn(vlm, engine, processor, monkeypatch):
    args = _args(vlm, engine)
    requests = []
    real_post = multi_turn.post_generate

    async def recording_post(args, input_ids, params, image_data=None, prompt=None):
        requests.append({"ids": list(input_ids), "image_data": list(image_data or []), "prompt": prompt})
        return await real_post(args, input_ids, params, image_data, prompt)

    monkeypatch.setattr(multi_turn, "post_generate", recording_post)
    calls = []

    def call_tool(call):
        calls.append(call)
        return [{"type": "text", "text": "look again"}, {"type": "image", "image": OBSERVATION_IMAGES[len(calls) - 1]}]

    vocab = processor.tokenizer.vocab_size + len(processor.tokenizer.get_added_vocab())
    params = {"temperature": 1.0, "max_new_tokens": 3, "stop_token_ids": list(range(vocab)), "sampling_seed": 7,
              "no_stop_trim": True, "skip_special_tokens": False, "spaces_between_special_tokens": False}
    sample = _sample()
    run_sync(tool_loop(args, sample, params, call_tool=call_tool, parse_call=lambda text: "call"))

    # three one-token model turns, two tool results appended (the third call is past --max-turns)
    assert sample.metadata == {"turns": 3, "tool_calls": 2} and sample.status == Sample.Status.TRUNCATED
    images = [PROMPT_IMAGE] + OBSERVATION_IMAGES[:2]
    assert sample.multimodal_inputs["images"] == images

    # every request carries every image so far, as the engine takes it
    assert len(requests) == 3
    for k, request in enumerate(requests):
        assert request["image_data"] == [encode_image_for_rollout_engine(im) for im in images[: k + 1]]
    prompt_ids, prompt_images = processed_image_prompt(args, _sample())
    first = requests[0]
    assert first["prompt"].count("<|image_pad|>") == 1 and first["ids"] == prompt_ids
    pad = processor.image_token_id
    for k in (1, 2):
        assert requests[k]["ids"] == sample.tokens[: len(requests[k]["ids"])]
        assert len(requests[k]["ids"]) > len(requests[k - 1]["ids"])
        short = requests[k]["prompt"]  # one image token per image so far; the engine expands them
        assert short.count(pad) == k + 1 and [t for t in short if t != pad] == [
            t for t in requests[k]["ids"] if t != pad]

    # ids, masks, log-probs: prompt (expanded) + turn + observation + turn + observation + turn
    assert sample.tokens[: len(prompt_ids)] == prompt_ids
    assert sample.response_length == len(sample.tokens) - len(prompt_ids)
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    trained = [k for k, m in enumerate(sample.loss_mask) if m]
    assert len(trained) == 3 and trained[0] == 0 and trained[-1] == sample.response_length - 1
    assert all(sample.rollout_log_probs[k] == 0.0 for k in range(sample.response_length) if k not in trained)
    response = sample.tokens[len(prompt_ids):]
    for n, (a, b) in enumerate(zip(trained, trained[1:])):
        expected = render_observation(args, call_tool_result(n), last_token=response[a])
        assert response[a + 1: b] == expected.ids

    # the processed images: the prompt's, then each observation's, in the order of their runs
    train = sample.multimodal_train_inputs
    want = _processed(processor, images)
    assert torch.equal(train["image_grid_thw"], want["image_grid_thw"])
    assert torch.equal(train["pixel_values"], want["pixel_values"])
    assert torch.equal(train["image_grid_thw"][:1], prompt_images["image_grid_thw"])
    config = processor.tokenizer
    image_token, start, end = (config.convert_tokens_to_ids(t) for t in
                               ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    counts = image_token_counts(train["image_grid_thw"], 2)
    assert counts[1] != counts[2]  # the observations differ in size, so in token count
    stray = stray_image_tokens(sample.tokens, image_token, counts, start, end)
    assert all(sample.loss_mask[p - len(prompt_ids)] == 1 for p in stray)  # only the policy samples stray ones
    held = [(s, n) for s, n in token_runs(sample.tokens, image_token) if s not in stray]
    assert [n for _, n in held] == counts
    assert held[0][0] < len(prompt_ids) and all(s >= len(prompt_ids) for s, _ in held[1:])
    assert all(sample.loss_mask[s - len(prompt_ids) + i] == 0 for s, n in held[1:] for i in range(n))

    # the trainer's forward (its checks of the row's image runs included) gives the rollout's log-probs
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    mb = make_micro_batch([sample.tokens], [sample.response_length])
    with torch.no_grad():
        lp, _ = forward_response_log_probs(model, mb, 1.0,
                                           images=micro_batch_images([train], [0], "cpu", [sample.loss_mask]))
    diffs = [abs(float(lp[0, k]) - sample.rollout_log_probs[k]) for k in trained]
    assert max(diffs) < TOL, diffs
    # without the observations' pixels the trainer refuses the row, naming the missing images
    only_prompt = {k: v[: int(prompt_images["pixel_values"].shape[0])] if k == "pixel_values" else v[:1]
                   for k, v in train.items()}
    with pytest.raises(ValueError, match="have no image|found none"):
        forward_response_log_probs(model, mb, 1.0, images=micro_batch_images([only_prompt], [0], "cpu",
                                                                               [sample.loss_mask]))


def call_tool_result(n: int) -> list[dict]:
    return [{"type": "text", "text": "look again"}, {"type": "image", "image": OBSERVATION_IMAGES[n]}]


def test_render_observation_of_text_is_render_tool_message(vlm):
    args = _args(vlm)
    tokenizer = load_processor(vlm, trust_remote_code=True).tokenizer
    text = render_observation(args, "result one", last_token=None)
    assert text == Observation(render_tool_message(tokenizer, "result one"))
    parts = render_observation(args, [{"type": "text", "text": "result one"}])
    assert parts.ids == text.ids and parts.images == [] and parts.train_inputs is None
    two = render_observation(args, ["result one", "result two"])
    assert two.ids == render_tool_message(tokenizer, ["result one", "result two"])
    with pytest.raises(TypeError, match="render_observation"):
        render_tool_message(tokenizer, [{"type": "image", "image": PROMPT_IMAGE}])
    with pytest.raises(ValueError, match="holds no image"):
        render_observation(args, [{"type": "image"}])


def test_an_observation_image_expands_like_the_processor(vlm, processor):
    args = _args(vlm)
    image = OBSERVATION_IMAGES[2]
    obs = render_observation(args, [{"type": "image", "image": encode_image_for_rollout_engine(image)},
                                    {"type": "text", "text": "look again"}])
    text = "<|im_end|>\n<|im_start|>tool\n<|vision_start|><|image_pad|><|vision_end|>look again<|im_end|>\n" \
           "<|im_start|>assistant\n"
    want = processor(text=text, **build_processor_kwargs({"images": [image]}))
    assert obs.ids == list(want["input_ids"][0]) and obs.ids.count(processor.image_token_id) == 4
    assert torch.equal(obs.train_inputs["pixel_values"], want["pixel_values"])
    assert [im.tobytes() for im in obs.images] == [image.tobytes()]


def test_later_turns_go_to_sglang_as_one_image_token_per_image_unless_the_policy_sampled_one(vlm, processor):
    args = _args(vlm, rollout_backend="sglang")
    sample = _sample(index=3)
    images, text = image_request(args, sample)  # the first turn goes as text: SGLang takes it
    assert len(images) == 1 and text.count("<|image_pad|>") == 1
    prompt = processed_image_prompt(args, sample)[0]
    pad = processor.image_token_id
    sample.tokens = prompt + [5]
    sample.response_length, sample.loss_mask, sample.rollout_log_probs = 1, [1], [-1.0]
    short = image_request(args, sample)[1]
    assert short.count(pad) == 1 and len(short) == len(sample.tokens) - prompt.count(pad) + 1
    sample.tokens = prompt + [pad]  # the policy sampled the image token: the short form cannot tell it apart
    with pytest.raises(ValueError, match="sample 3 has images and a response holding image tokens.*sglang.*"
                                         "--rollout-backend hf"):
        image_request(args, sample)
    assert image_request(_args(vlm, rollout_backend="hf"), sample)[1] is None  # the hf engine takes the full ids


def test_images_need_a_vision_language_checkpoint(tmp_path):
    from tools.make_tiny_model import build_tokenizer

    build_tokenizer(str(tmp_path))
    args = _args(str(tmp_path))
    with pytest.raises(ValueError, match="has no multimodal processor"):
        render_observation(args, [{"type": "image", "image": PROMPT_IMAGE}])


@pytest.mark.timeout(300)
def test_the_train_plugin_runs_its_turns_with_images(vlm, engine):
    """tests/e2e_cpu/plugins/image_tool_loop.py (the docs' train.py command): three one-token turns, a crop of the
    prompt's image after each of the first two, the row's images and pixels in order."""
    from tests.e2e_cpu.plugins.image_tool_loop import generate

    params = {"temperature": 1.0, "max_new_tokens": 2, "sampling_seed": 3}
    sample = run_sync(generate(_args(vlm, engine), _sample(), params))
    assert sample.metadata == {"turns": 3, "tool_calls": 2} and sum(sample.loss_mask) == 3
    images = sample.multimodal_inputs["images"]
    assert images[0] is PROMPT_IMAGE and [im.size for im in images[1:]] == [(28, 84), (28, 84)]
    assert sample.multimodal_train_inputs["image_grid_thw"].shape[0] == 3
