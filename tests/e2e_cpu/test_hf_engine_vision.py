"""The hf engine serving the tiny Qwen2.5-VL and the tiny Qwen3-VL over HTTP: `image_data` in /generate as SGLang takes it, log-probs
equal to transformers' own forward of the same sequence with the same image, and the 400s of bad requests."""

import os
import sys

import httpx
import pytest
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from slime.backends.hf_engine.engine import HFEngine
from slime.utils.processing_utils import build_processor_kwargs, encode_image_for_rollout_engine, load_processor
from tests.args import make_args

TOL = 1e-5
QUESTION = "which colour fills the image?"


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm(request, tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / request.param), arch=request.param, size="tiny",
                           seed=0)


@pytest.fixture(scope="module")
def url(vlm):
    eng = HFEngine(make_args(hf_checkpoint=vlm, rollout_seed=1, sglang_server_concurrency=8), rank=0)
    try:
        eng.init()
        yield eng.get_url()
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def processor(vlm):
    return load_processor(vlm, trust_remote_code=True)


@pytest.fixture(scope="module")
def reference(vlm):
    from transformers import AutoModelForImageTextToText

    torch.set_num_threads(1)
    return AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()


def prompt_text(processor):
    messages = [{"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "text", "text": QUESTION}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def image(color, size=(60, 90)):
    return Image.new("RGB", size, color)


def post(url, **body):
    return httpx.post(url + "/generate", json=body, timeout=60.0)


def generate(url, **body):
    resp = post(url, **body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def reference_logprobs(model, processor, ids, img):
    """log p(ids[j] | ids[:j]) for j >= 1 from transformers' forward (its own 3-D positions)."""
    pixels = processor.image_processor(images=[img], return_tensors="pt")
    t = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=t, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=(t == processor.image_token_id).int()).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, t[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()


def max_diff(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


SAMPLING = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.timeout(180)
def test_text_with_image_data_matches_transformers(url, processor, reference):
    img = image((255, 0, 0))
    text = prompt_text(processor)
    out = generate(url, text=text, image_data=[encode_image_for_rollout_engine(img)], sampling_params=SAMPLING,
                   return_logprob=True)
    expanded = processor(text=text, **build_processor_kwargs({"images": [img]}))["input_ids"][0]
    assert out["meta_info"]["prompt_tokens"] == len(expanded) > len(processor.tokenizer(text)["input_ids"])
    ids = expanded + out["output_ids"]
    engine = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    ref = reference_logprobs(reference, processor, ids, img)[len(expanded) - 1:]
    assert len(out["output_ids"]) == 6 and max_diff(engine, ref) < TOL
    # greedy: each output token is transformers' argmax after the prefix
    t = torch.tensor([ids])
    pixels = processor.image_processor(images=[img], return_tensors="pt")
    with torch.no_grad():
        logits = reference(input_ids=t, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                           mm_token_type_ids=(t == processor.image_token_id).int()).logits[0]
    assert logits[len(expanded) - 1:-1].argmax(-1).tolist() == out["output_ids"]


@pytest.mark.timeout(180)
def test_input_ids_expanded_or_not_and_prompt_logprobs(url, processor, reference):
    img = image((0, 0, 255), size=(56, 56))
    data = encode_image_for_rollout_engine(img)
    text = prompt_text(processor)
    from_text = generate(url, text=text, image_data=data, sampling_params=SAMPLING, return_logprob=True)
    expanded = processor(text=text, **build_processor_kwargs({"images": [img]}))["input_ids"][0]
    unexpanded = processor.tokenizer(text)["input_ids"]
    for ids in (expanded, unexpanded):
        out = generate(url, input_ids=ids, image_data=[data], sampling_params=SAMPLING, return_logprob=True)
        assert out["output_ids"] == from_text["output_ids"]
        assert out["meta_info"]["output_token_logprobs"] == from_text["meta_info"]["output_token_logprobs"]
    scored = generate(url, input_ids=expanded, image_data=[data], return_logprob=True, logprob_start_len=0,
                      sampling_params={"max_new_tokens": 0})
    engine = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][1:]]
    assert max_diff(engine, reference_logprobs(reference, processor, expanded, img)) < TOL


@pytest.mark.timeout(180)
def test_batch_with_and_without_images(url, processor):
    text = prompt_text(processor)
    plain = processor.tokenizer("<|im_start|>user what comes after one ?<|im_end|><|im_start|>assistant")["input_ids"]
    red, green = (encode_image_for_rollout_engine(image(c)) for c in [(255, 0, 0), (0, 255, 0)])
    batch = generate(url, text=[text, text, processor.tokenizer.decode(plain, skip_special_tokens=False)],
                     image_data=[red, [green], None], sampling_params=SAMPLING, return_logprob=True)
    alone = [generate(url, text=text, image_data=red, sampling_params=SAMPLING, return_logprob=True),
             generate(url, text=text, image_data=[green], sampling_params=SAMPLING, return_logprob=True),
             generate(url, input_ids=plain, sampling_params=SAMPLING, return_logprob=True)]
    for b, a in zip(batch, alone):
        assert b["output_ids"] == a["output_ids"]
        lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        assert max_diff(lb, la) < TOL
    lr = [lp for lp, _, _ in batch[0]["meta_info"]["output_token_logprobs"]]
    lg = [lp for lp, _, _ in batch[1]["meta_info"]["output_token_logprobs"]]
    assert max_diff(lr, lg) > 1e-4  # the image's colour reaches the model


@pytest.mark.timeout(60)
def test_bad_image_requests_answer_400(url, processor):
    text = prompt_text(processor)
    data = encode_image_for_rollout_engine(image((255, 0, 0)))
    cases = [
        (dict(text=text, image_data="data:image/png;base64,bm90IGFuIGltYWdl"), "not a readable image"),
        (dict(text=text, image_data="https://example.com/cat.png"), "fetches no URLs"),
        (dict(input_ids=processor.tokenizer(text)["input_ids"] * 2, image_data=[data]), "runs of image tokens"),
        (dict(text=text + text, image_data=[data]), "2 image placeholder(s)"),
        (dict(text=text), "holds image tokens (id"),
        (dict(text=[text, text], image_data=[data]), "image_data has 1 entries but the batch has 2"),
    ]
    for body, message in cases:
        resp = post(url, sampling_params={"max_new_tokens": 2}, **body)
        assert resp.status_code == 400 and message in resp.json()["message"], resp.text
    assert post(url, text=text, image_data=data, sampling_params={"max_new_tokens": 1}).status_code == 200
    assert httpx.get(url + "/model_info", timeout=10).json()["has_image_understanding"] is True


def test_text_only_model_refuses_image_data(tiny_model_dir):
    from slime.backends.hf_engine.scheduler import Scheduler
    from slime.backends.hf_engine.server import EngineState, load_model, parse_generate

    model, tokenizer = load_model(tiny_model_dir, "float32", "cpu")
    state = EngineState(model, tokenizer, Scheduler(model, tokenizer), model_path=tiny_model_dir, device="cpu",
                        dtype="float32")
    with pytest.raises(ValueError, match="is text-only"):
        parse_generate({"input_ids": [1, 2, 3], "image_data": ["data:image/png;base64,AAAA"]}, state)
    assert parse_generate({"input_ids": [1, 2, 3]}, state)[0][0].vision is None


@pytest.mark.timeout(120)
def test_slot_cache_serves_image_rows_as_transformers(vlm, processor, reference):
    """Image rows in the slot cache (each continues from its 3-D RoPE positions, not its count of cached tokens:
    `SlotCache.offsets`), next to a text row, give the dynamic cache's tokens and transformers' log-probs."""
    from transformers import AutoTokenizer

    from slime.backends.hf_engine.scheduler import Request, SamplingParams, Scheduler
    from slime.backends.hf_engine.vision import image_inputs, vision_markers

    tokenizer = AutoTokenizer.from_pretrained(vlm)
    text = prompt_text(processor)
    # a square image's tokens span fewer 3-D positions than their count (a 2x2 grid: 2 per axis), so its row's next
    # position is not its length; a 1 x 3 one's span equals its count
    images = [image((255, 0, 0), size=(56, 56)), image((0, 0, 255), size=(28, 84))]
    plain = processor.tokenizer("<|im_start|>user what comes after one ?<|im_end|><|im_start|>assistant")["input_ids"]

    def requests():
        out = []
        for k, img in enumerate(images):
            ids, vision = image_inputs(processor, [encode_image_for_rollout_engine(img)], vision_markers(reference),
                                       text=text)
            params = SamplingParams.from_dict({**SAMPLING, "temperature": 1.0, "sampling_seed": 70 + k})
            out.append(Request(rid=f"i{k}", input_ids=ids, params=params, return_logprob=True, vision=vision))
        params = SamplingParams.from_dict({**SAMPLING, "temperature": 1.0, "sampling_seed": 79})
        return out + [Request(rid="t", input_ids=list(plain), params=params, return_logprob=True)]

    runs = {}
    for kv_cache in ("dynamic", "slots"):
        sched = Scheduler(reference, tokenizer, kv_cache=kv_cache, cuda_graphs=False)
        assert sched.kv_cache == kv_cache
        reqs = requests()
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        runs[kv_cache] = reqs
    for d, s in zip(runs["dynamic"], runs["slots"]):
        assert s.output_ids == d.output_ids
        assert max_diff(s.output_logprobs, d.output_logprobs) < TOL
    # against transformers' own forward of the sequence (rows where the policy sampled an image token are left out:
    # this reference would take it for an image's)
    compared = [(r, img) for r, img in zip(runs["slots"], images) if processor.image_token_id not in r.output_ids]
    assert compared
    for r, img in compared:
        ref = reference_logprobs(reference, processor, r.input_ids + r.output_ids, img)[len(r.input_ids) - 1:]
        assert max_diff(r.output_logprobs, ref) < TOL


@pytest.mark.timeout(120)
def test_a_groups_image_prompt_is_prefilled_once_with_the_same_results(vlm, processor, reference):
    """A GRPO group's samples (one prompt, one image) share one prefill: one vision-tower and prompt forward per
    distinct prompt and images, and every sample's tokens and log-probs are those of its own prefill."""
    from transformers import AutoTokenizer

    from slime.backends.hf_engine.scheduler import Request, SamplingParams, Scheduler
    from slime.backends.hf_engine.vision import image_inputs, vision_markers

    tokenizer = AutoTokenizer.from_pretrained(vlm)
    text = prompt_text(processor)
    red, green = (encode_image_for_rollout_engine(image(c)) for c in [(255, 0, 0), (0, 255, 0)])

    def requests():
        out = []
        for k, img in enumerate([red, red, red, green, red]):  # a late sample of the red group still shares
            ids, vision = image_inputs(processor, [img], vision_markers(reference), text=text)
            params = SamplingParams.from_dict({**SAMPLING, "temperature": 1.0, "sampling_seed": 50 + k})
            out.append(Request(rid=f"r{k}", input_ids=ids, params=params, return_logprob=True, vision=vision))
        return out

    results = {}
    for shared in (True, False):
        sched = Scheduler(reference, tokenizer, shared_prefill=shared)
        reqs = requests()
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        results[shared] = (reqs, sched.stats)
    (shared_reqs, shared_stats), (alone_reqs, alone_stats) = results[True], results[False]
    assert shared_stats["num_prefill_rows"] == 2 and shared_stats["num_shared_prefill_rows"] == 3
    assert alone_stats["num_prefill_rows"] == 5 and alone_stats["num_shared_prefill_rows"] == 0
    assert len({tuple(r.output_ids) for r in shared_reqs}) > 2  # each sample draws from its own generator
    for a, b in zip(shared_reqs, alone_reqs):
        assert a.output_ids == b.output_ids
        assert max_diff(a.output_logprobs, b.output_logprobs) < TOL
