"""HTTP contract of a rollout engine serving a vision-language model: `/generate` with `image_data`, in the shape
slime's rollout sends it (slime/rollout/generation.py): the prompt as `text` with one image placeholder per image
and the images as PNG data URLs, which the server expands with its own processor.

CI runs it against an `hf` engine on the tiny Qwen2.5-VL and on the tiny Qwen3-VL (conftest.py's `vision_engine`,
one per `vision_arch`); with `--engine-url` it
runs against that server when it serves a vision-language model (tests/gpu/test_vlm_sglang_gpu.py starts SGLang on
the tiny Qwen2.5-VL for it). Checked: the server's prompt is the one the trainer trains on (its token count equals
the local processor's expansion) and its log-probs are a transformers fp32 forward's of the same sequence and
image (to --logprob-tol; a prompt's are compared where the next token is not an image placeholder:
`text_target_logprobs`); a continued sample sent as ids with one image token per image expands back to its own
ids; a batch mixing prompts with and without images answers each as alone; a weight push to
the vision tower reaches image requests at once, also for an image the server has seen before the push (SGLang
caches vision-tower outputs by image unless SGLANG_VLM_CACHE_SIZE_MB=0, which slime's servers get), leaves
text-only requests alone, and the restore brings the log-probs back.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from PIL import Image

from slime.utils.processing_utils import build_processor_kwargs, encode_image_for_rollout_engine, load_processor
from tests.contract.test_engine_api import generate, max_diff, model_tensors, push_tensor

pytestmark = pytest.mark.timeout(300)

QUESTION = "which colour fills the image?"
SAMPLING = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
# the merger's last projection (Qwen2.5-VL's name, then Qwen3-VL's): its output is what the text model sees of an
# image
TOWER_TENSORS = ("visual.merger.mlp.2.weight", "visual.merger.linear_fc2.weight")


@pytest.fixture(scope="module")
def processor(vision_engine):
    return load_processor(vision_engine.model_path, trust_remote_code=True)


@pytest.fixture(scope="module")
def reference(vision_engine):
    """The model in transformers, fp32; None for a model over 1 GiB (too big to load a copy here)."""
    from transformers import AutoModelForImageTextToText

    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(vision_engine.model_path, "*.safetensors")))
    if size > 2**30:
        return None
    return AutoModelForImageTextToText.from_pretrained(vision_engine.model_path, dtype=torch.float32).eval()


def prompt_text(processor, n_images=1):
    content = [{"type": "image", "image": "x"}] * n_images + [{"type": "text", "text": QUESTION}]
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def image(color, size=(56, 84)):
    return Image.new("RGB", size, color)


def expanded_ids(processor, text, images):
    return processor(text=text, **build_processor_kwargs({"images": images}))["input_ids"][0]


def reference_logprobs(model, processor, ids, images) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1 from transformers' forward (its own 3-D positions)."""
    pixels = processor.image_processor(images=images, return_tensors="pt")
    t = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=t, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=(t == processor.image_token_id).int()).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, t[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()


def text_target_logprobs(logprobs: list[float], ids: list[int], image_token_id: int) -> list[float]:
    """The prompt log-probs `logprobs[k] = log p(ids[k + 1] | ids[:k + 1])` whose target `ids[k + 1]` is not an image
    placeholder. SGLang 0.5.16 puts each image's hash in place of its placeholders and scores those targets as the
    token `vocab_size - 1` (managers/schedule_batch.py clamps `extend_input_logprob_token_ids` into the vocabulary;
    layers/logprob_processor.py gathers at them), so its log-probs there are not the placeholder's (up to 0.37 apart
    on the tiny Qwen2.5-VL). No trained token is a placeholder: the rest is what must agree."""
    assert len(logprobs) == len(ids) - 1, (len(logprobs), len(ids))
    return [lp for lp, target in zip(logprobs, ids[1:]) if target != image_token_id]


def output_logprobs(out) -> list[float]:
    return [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]


def scored(engine, text, images) -> tuple[list[float], str]:
    """The engine's log-probs of the prompt's tokens after the first (max_new_tokens 0) and its weight version."""
    body = {"text": text, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}, "return_logprob": True,
            "logprob_start_len": 0}
    if images:
        body["image_data"] = [encode_image_for_rollout_engine(img) for img in images]
    out = generate(engine, **body)
    return [lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]], out["meta_info"]["weight_version"]


def test_text_with_image_data_is_the_trained_prompt(vision_engine, processor, reference):
    images = [image((255, 0, 0)), image((0, 0, 255), size=(28, 28))]
    text = prompt_text(processor, n_images=2)
    out = generate(vision_engine, text=text, image_data=[encode_image_for_rollout_engine(i) for i in images],
                   sampling_params=SAMPLING, return_logprob=True)
    ids = expanded_ids(processor, text, images)
    assert ids.count(processor.image_token_id) > len(images)  # an image expanded to several tokens
    # the server expanded the placeholders to the ids slime's rollout keeps for training
    assert out["meta_info"]["prompt_tokens"] == len(ids), (out["meta_info"]["prompt_tokens"], len(ids))
    assert len(out["output_ids"]) == SAMPLING["max_new_tokens"]
    if reference is not None:
        ref = reference_logprobs(reference, processor, ids + out["output_ids"], images)[len(ids) - 1:]
        assert max_diff(output_logprobs(out), ref) <= vision_engine.logprob_tol


def test_scoring_a_prompt_with_an_image_matches_transformers(vision_engine, processor, reference):
    img = image((0, 255, 0))
    text = prompt_text(processor)
    engine, _ = scored(vision_engine, text, [img])
    ids = expanded_ids(processor, text, [img])
    assert len(engine) == len(ids) - 1
    if reference is not None:
        ref = reference_logprobs(reference, processor, ids, [img])
        assert max_diff(*(text_target_logprobs(lps, ids, processor.image_token_id) for lps in (engine, ref))) \
            <= vision_engine.logprob_tol


def test_a_continued_sample_goes_as_one_image_token_per_image(vision_engine, processor, reference):
    """A sample continued after a response (slime's partial rollouts, later multi-turn turns, OPD teachers) goes as
    its ids with each image's run of image tokens cut to one (slime/rollout/generation.py `image_request`): the server
    expands them back to exactly the sample's ids, and scores the response as transformers does."""
    from slime.utils.image_tokens import collapse_image_runs

    images = [image((255, 0, 0)), image((0, 0, 255), size=(28, 28))]
    data = [encode_image_for_rollout_engine(img) for img in images]
    text = prompt_text(processor, n_images=2)
    first = generate(vision_engine, text=text, image_data=data, sampling_params=SAMPLING, return_logprob=True)
    ids = expanded_ids(processor, text, images) + first["output_ids"]  # the sample after one turn
    tok = processor.tokenizer.convert_tokens_to_ids
    short = collapse_image_runs(ids, processor.image_token_id, tok("<|vision_start|>"), tok("<|vision_end|>"), 2)
    assert short is not None and short.count(processor.image_token_id) == 2 and len(short) < len(ids)
    out = generate(vision_engine, input_ids=short, image_data=data, return_logprob=True, logprob_start_len=0,
                   sampling_params={"max_new_tokens": 0, "temperature": 1.0})
    assert out["meta_info"]["prompt_tokens"] == len(ids), (out["meta_info"]["prompt_tokens"], len(ids))
    engine = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]]
    assert len(engine) == len(ids) - 1
    if reference is not None:
        ref = reference_logprobs(reference, processor, ids, images)
        assert max_diff(*(text_target_logprobs(lps, ids, processor.image_token_id) for lps in (engine, ref))) \
            <= vision_engine.logprob_tol


def test_batch_mixing_prompts_with_and_without_images(vision_engine, processor):
    text = prompt_text(processor)
    plain = "<|im_start|>user what comes after one ?<|im_end|><|im_start|>assistant"
    red, green = (encode_image_for_rollout_engine(image(c)) for c in [(255, 0, 0), (0, 255, 0)])
    batch = generate(vision_engine, text=[text, text, plain], image_data=[[red], [green], None],
                     sampling_params=SAMPLING, return_logprob=True)
    alone = [generate(vision_engine, text=text, image_data=[red], sampling_params=SAMPLING, return_logprob=True),
             generate(vision_engine, text=text, image_data=[green], sampling_params=SAMPLING, return_logprob=True),
             generate(vision_engine, text=plain, sampling_params=SAMPLING, return_logprob=True)]
    for b, a in zip(batch, alone):
        assert b["meta_info"]["prompt_tokens"] == a["meta_info"]["prompt_tokens"]
        assert len(b["output_ids"]) == len(a["output_ids"]) == SAMPLING["max_new_tokens"]
        # the tokens sampled alone, scored in the batch's order: greedy picks may differ within bf16 noise, so
        # compare log-probs only while the two agree
        same = next((k for k, (x, y) in enumerate(zip(b["output_ids"], a["output_ids"])) if x != y), None)
        n = SAMPLING["max_new_tokens"] if same is None else same
        assert n >= 1 and max_diff(output_logprobs(b)[:n], output_logprobs(a)[:n]) <= vision_engine.logprob_tol


def test_push_to_the_vision_tower_reaches_image_requests(vision_engine, processor, reference, tmp_path):
    """Push the merger's last projection scaled x1000 (what the text model sees of an image changes completely),
    then the original back. The image's log-probs move after the push, also for an image scored before it (no
    stale vision-tower output); a text-only prompt's do not; after the restore both are back."""
    if vision_engine.external and not vision_engine.same_host:
        pytest.skip("the tensor push hands over shared memory: pass --engine-same-host for an external engine")
    tensors = model_tensors(vision_engine.model_path)
    found = [name for name in tensors if name.endswith(TOWER_TENSORS)]
    assert len(found) == 1, f"none or several of {TOWER_TENSORS} in {vision_engine.model_path}: {found}"
    tower_tensor = found[0]
    original = tensors[tower_tensor]
    perturbed = original * 1000.0
    img = image((255, 0, 0))
    text, plain = prompt_text(processor), "<|im_start|>user what comes after one ?<|im_end|><|im_start|>assistant"
    before, _ = scored(vision_engine, text, [img])
    plain_before, _ = scored(vision_engine, plain, [])
    tol = vision_engine.logprob_tol
    try:
        push_tensor(vision_engine, [(tower_tensor, perturbed)], "contract-vision-1")
        after, version = scored(vision_engine, text, [img])
        plain_after, _ = scored(vision_engine, plain, [])
        print(f"\n[vision push] image prompt max |Δ log-prob| {max_diff(after, before):.3f}, text prompt "
              f"{max_diff(plain_after, plain_before):.2e}")
        assert version == "contract-vision-1"
        assert max_diff(after, before) > 2 * tol, "the pushed vision tower did not change the image's log-probs"
        assert max_diff(plain_after, plain_before) <= tol
        if reference is not None:
            state = reference.state_dict()
            key = next(k for k in state if k.endswith("visual." + tower_tensor.split("visual.", 1)[1]))
            state[key].copy_(perturbed)
            try:
                ids = expanded_ids(processor, text, [img])
                ref = reference_logprobs(reference, processor, ids, [img])
                assert max_diff(*(text_target_logprobs(lps, ids, processor.image_token_id) for lps in (after, ref))) \
                    <= tol
            finally:
                state[key].copy_(original)
    finally:
        push_tensor(vision_engine, [(tower_tensor, original)], "contract-vision-2")
    restored, version = scored(vision_engine, text, [img])
    assert version == "contract-vision-2" and max_diff(restored, before) <= tol

