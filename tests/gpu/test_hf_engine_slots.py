"""The hf engine's slot KV cache with CUDA-graph decode and the overlap schedule (its defaults on CUDA) gives the
dynamic cache's tokens and log-probs, and the plain schedule's, also after in-place weight updates, after the
model moved off and back onto the GPU, and with the fused rotary embedding and the joined projections in the
graphs (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from slime.backends.hf_engine.scheduler import Request, SamplingParams, Scheduler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = 1e-4


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), size="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    return model, AutoTokenizer.from_pretrained(path)


def requests(count: int = 12) -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        prompt = torch.randint(3, 150, (int(torch.randint(2, 40, (1,), generator=gen)),), generator=gen).tolist()
        params = SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, sampling_seed=1000 + i,
                                max_new_tokens=int(torch.randint(1, 150, (1,), generator=gen)), ignore_eos=True)
        out.append(Request(rid=str(i), input_ids=prompt, params=params, return_logprob=True))
    return out


def serve(sched: Scheduler, reqs: list[Request]) -> list[Request]:
    """Half the requests first, the rest after a few decode steps (merges, finishes, column growth)."""
    for r in reqs[: len(reqs) // 2]:
        sched.submit(r)
    for _ in range(5):
        with sched.step_lock:
            sched.step()
    for r in reqs[len(reqs) // 2:]:
        sched.submit(r)
    sched.run_until_idle()
    return reqs


def assert_same(a: list[Request], b: list[Request]) -> None:
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids, x.rid
        assert max(abs(p - q) for p, q in zip(x.output_logprobs, y.output_logprobs)) < TOL, x.rid


def test_slots_with_cuda_graphs_match_the_dynamic_cache(model_and_tokenizer):
    model, tok = model_and_tokenizer
    dynamic = Scheduler(model, tok, kv_cache="dynamic", max_running_requests=5)
    slots = Scheduler(model, tok, kv_cache="slots", max_running_requests=5)
    plain = Scheduler(model, tok, kv_cache="slots", max_running_requests=5, overlap=False)
    assert slots.kv_cache == "slots" and slots.overlap and not plain.overlap
    assert_same(serve(dynamic, requests()), serve(slots, requests()))
    assert_same(serve(plain, requests()), serve(slots, requests()))
    assert slots.stats["num_cuda_graphs"] >= 2
    # full forward of prompt + output reproduces the engine's log-probs
    r = serve(slots, requests(3))[1]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([r.input_ids + r.output_ids], device="cuda")).logits[0].float()
    ref = torch.log_softmax(logits[:-1] / r.params.temperature, -1).gather(
        -1, torch.tensor(r.input_ids[1:] + r.output_ids, device="cuda").unsqueeze(-1)).squeeze(-1)
    assert max(abs(p - q) for p, q in zip(r.output_logprobs, ref[len(r.input_ids) - 1:].tolist())) < TOL

    # In-place weight change: the captured graphs read the new values.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    assert_same(serve(dynamic, requests()), serve(slots, requests()))

    # Moving the model (release / resume of weights) needs the graphs dropped; then they are recaptured.
    with slots.exclusive():
        slots.drop_graphs()
        model.to("cpu")
        model.to("cuda")
    assert_same(serve(dynamic, requests()), serve(slots, requests()))
    assert slots.free_idle_kv_cache()


def test_fused_rotary_in_cuda_graphs_gives_transformers_tokens(model_and_tokenizer):
    """The engine's default on CUDA: the rotary embedding as one Triton kernel per tensor (fused_rotary.py),
    captured in the decode graphs, against transformers' own rotation in the dynamic cache."""
    from slime.backends.hf_engine.fused_rotary import fuse_rotary, restore_rotary

    model, tok = model_and_tokenizer
    want = serve(Scheduler(model, tok, kv_cache="dynamic", max_running_requests=5), requests())
    assert fuse_rotary(model) == 1
    try:
        slots = Scheduler(model, tok, kv_cache="slots", max_running_requests=5)
        got = serve(slots, requests())
        assert slots.stats["num_cuda_graphs"] >= 2
    finally:
        restore_rotary(model)
    assert_same(want, got)


def test_triton_decode_attention_in_cuda_graphs_gives_transformers_tokens(model_and_tokenizer):
    """`--decode-attention triton --disable-fused-kv-write` (decode_attention.py): the kernel reading each row's live
    columns, the step's KV written apart before it, captured in the decode graphs, against transformers' attention in
    the dynamic cache (fp32: the kernel multiplies in IEEE fp32), also after an in-place weight update."""
    from slime.backends.hf_engine import slots as slots_module

    model, tok = model_and_tokenizer
    dynamic = Scheduler(model, tok, kv_cache="dynamic", max_running_requests=5)
    slots = Scheduler(model, tok, kv_cache="slots", max_running_requests=5, decode_attention="triton",
                      fused_kv_write=False)
    calls = []
    kernel = slots_module.triton_decode_attention
    slots_module.triton_decode_attention = lambda *a: calls.append(a[5] is None) or kernel(*a)
    try:
        assert_same(serve(dynamic, requests()), serve(slots, requests()))
    finally:
        slots_module.triton_decode_attention = kernel
    assert calls and all(calls) and slots.stats["num_cuda_graphs"] >= 2  # each graph: the kernel once per layer
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.02)
    assert_same(serve(dynamic, requests()), serve(slots, requests()))


def test_fused_kv_write_in_cuda_graphs_gives_transformers_tokens(model_and_tokenizer):
    """The default on CUDA (the Triton decode attention with the KV writes fused into it): the kernel stores each
    step's keys and values itself (no indexed writes), captured in the decode graphs, against transformers' attention
    in the dynamic cache, also after an in-place weight update."""
    from slime.backends.hf_engine import slots as slots_module

    model, tok = model_and_tokenizer
    dynamic = Scheduler(model, tok, kv_cache="dynamic", max_running_requests=5)
    slots = Scheduler(model, tok, kv_cache="slots", max_running_requests=5)
    assert slots._slots.attention == "triton" and slots._slots.fused_kv_write
    writes = []
    kernel = slots_module.triton_decode_attention
    slots_module.triton_decode_attention = lambda *a: writes.append(a[5] is not None) or kernel(*a)
    try:
        assert_same(serve(dynamic, requests()), serve(slots, requests()))
    finally:
        slots_module.triton_decode_attention = kernel
    assert writes and all(writes) and slots.stats["num_cuda_graphs"] >= 2
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.02)
    assert_same(serve(dynamic, requests()), serve(slots, requests()))


def test_joined_projections_in_cuda_graphs_give_transformers_tokens(tmp_path):
    """The engine's default on CUDA: q/k/v and gate/up as one product each (fused_projections.py), captured in the
    decode graphs, against transformers' separate products in the dynamic cache; an in-place weight update (a push
    copies into the joined storage) and a release/resume of the weights (release.py) keep them joined, and the
    graphs read the new values."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime.backends.hf_engine.fused_projections import ATTENTION, join_projections, joined
    from slime.backends.hf_engine.release import WeightMemory
    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(str(tmp_path / "m"), size="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    twin = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert join_projections(twin) == 2 * len(twin.model.layers)
    memory = WeightMemory(twin, "cpu_backup")
    dynamic = Scheduler(model, tok, kv_cache="dynamic", max_running_requests=5)
    slots = Scheduler(twin, tok, kv_cache="slots", max_running_requests=5)
    assert_same(serve(dynamic, requests()), serve(slots, requests()))
    assert slots.stats["num_cuda_graphs"] >= 2
    with torch.no_grad():
        for a, b in zip(model.parameters(), twin.parameters()):
            a.mul_(1.05)
            b.copy_(a)
    assert_same(serve(dynamic, requests()), serve(slots, requests()))
    with slots.exclusive():
        memory.release()
        memory.resume()
        slots.drop_graphs()
    attention = twin.model.layers[0].self_attn
    assert joined([getattr(attention, n).weight for n in ATTENTION]) is not None
    assert_same(serve(dynamic, requests()), serve(slots, requests()))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_image_rows_decode_in_cuda_graphs_as_in_the_dynamic_cache(arch, tmp_path):
    """A vision-language model's decode steps are captured as CUDA graphs too (rows with images continue from their
    3-D RoPE positions through `SlotCache.offsets`, a static input) and give the dynamic cache's tokens."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from slime.backends.hf_engine.vision import image_inputs, vision_markers
    from slime.utils.processing_utils import encode_image_for_rollout_engine, load_processor
    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(str(tmp_path / arch), arch=arch, size="tiny", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).cuda().eval()
    tokenizer, processor = AutoTokenizer.from_pretrained(path), load_processor(path, trust_remote_code=True)
    messages = [{"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "text", "text": "colour?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (28, 84), (0, 0, 255))]
    plain = tokenizer("<|im_start|>user what comes after one ?<|im_end|><|im_start|>assistant")["input_ids"]

    def image_requests() -> list[Request]:
        out = []
        for k in range(6):
            ids, vision = image_inputs(processor, [encode_image_for_rollout_engine(images[k % 2])],
                                       vision_markers(model), text=text)
            params = SamplingParams(temperature=0.0 if k % 3 == 0 else 1.0, sampling_seed=70 + k,
                                    max_new_tokens=20 + 17 * k, ignore_eos=True)
            out.append(Request(rid=f"i{k}", input_ids=ids, params=params, return_logprob=True, vision=vision))
        params = SamplingParams(temperature=1.0, sampling_seed=79, max_new_tokens=140, ignore_eos=True)
        return out + [Request(rid="t", input_ids=list(plain), params=params, return_logprob=True)]

    dynamic = Scheduler(model, tokenizer, kv_cache="dynamic", max_running_requests=5)
    slots = Scheduler(model, tokenizer, kv_cache="slots", max_running_requests=5)
    assert_same(serve(dynamic, image_requests()), serve(slots, image_requests()))
    assert slots.stats["num_cuda_graphs"] >= 2
