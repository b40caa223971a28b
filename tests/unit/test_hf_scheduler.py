"""The hf engine's scheduler in-process (no HTTP): batching must not change tokens or log-probs."""

import os
import sys
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from slime.backends.hf_engine.scheduler import Request, SamplingParams, Scheduler, sample_tokens

TOL = 1e-5
PROMPTS = [[56, 62, 137, 92, 138], [12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [30, 31, 32]]


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.make_tiny_model import make_tiny_model

    torch.set_num_threads(1)
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")), size="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def make_request(i, prompt, return_logprob=True, logprob_start_len=-1, **params):
    sp = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, **params}
    return Request(rid=f"r{i}", input_ids=list(prompt), params=SamplingParams.from_dict(sp),
                   return_logprob=return_logprob, logprob_start_len=logprob_start_len)


def run(model_and_tokenizer, reqs, **kw):
    sched = Scheduler(*model_and_tokenizer, **kw)
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    return sched


def reference_logprobs(model, ids, temperature=1.0):
    """log p(ids[j] | ids[:j]) for j >= 1 from one plain forward of the whole sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.mark.parametrize("kv_cache", ["dynamic", "slots"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_equals_single_and_full_forward(model_and_tokenizer, temperature, kv_cache):
    model = model_and_tokenizer[0]
    singles = []
    for i, p in enumerate(PROMPTS):
        r = make_request(i, p, temperature=temperature, sampling_seed=100 + i)
        run(model_and_tokenizer, [r], kv_cache=kv_cache)
        singles.append(r)

    # Two requests start together; two more join the running batch after three decode steps, and rows
    # of different lengths finish at different times (exercising cache merge and trim).
    batched = [make_request(i, p, temperature=temperature, sampling_seed=100 + i, max_new_tokens=12 - 2 * i)
               for i, p in enumerate(PROMPTS)]
    sched = Scheduler(*model_and_tokenizer, kv_cache=kv_cache)
    assert sched.kv_cache == kv_cache
    for r in batched[:2]:
        sched.submit(r)
    for _ in range(4):
        with sched.step_lock:
            sched.step()
    for r in batched[2:]:
        sched.submit(r)
    sched.run_until_idle()
    assert sched.stats["max_batch_size_seen"] == 4

    for s, b in zip(singles, batched):
        n = len(b.output_ids)
        assert b.finish_reason == {"type": "length", "length": n}
        assert b.output_ids == s.output_ids[:n]
        assert max(abs(x - y) for x, y in zip(b.output_logprobs, s.output_logprobs[:n])) < TOL
        ref = reference_logprobs(model, b.input_ids + b.output_ids, temperature or 1.0)[len(b.input_ids) - 1:]
        assert max(abs(x - y) for x, y in zip(b.output_logprobs, ref)) < TOL


@pytest.mark.parametrize("kv_cache", ["dynamic", "slots"])
def test_a_groups_prompt_is_prefilled_once_with_the_same_results(model_and_tokenizer, kv_cache):
    """GRPO groups (n requests of one prompt) in one prefill: one forward row per distinct prompt, and every
    request's tokens and log-probs are those of the prefill that ran each prompt itself."""
    model = model_and_tokenizer[0]

    def group_requests():
        return [make_request(8 * g + k, p, temperature=1.0, sampling_seed=1000 + 8 * g + k)
                for g, p in enumerate(PROMPTS[:3]) for k in range(4)]

    shared, alone = group_requests(), group_requests()
    sched = run(model_and_tokenizer, shared, kv_cache=kv_cache)
    assert sched.stats["num_prefill_steps"] == 1  # one burst, one forward
    assert sched.stats["num_prefill_rows"] == 3 and sched.stats["num_shared_prefill_rows"] == 9
    sched = run(model_and_tokenizer, alone, kv_cache=kv_cache, shared_prefill=False)
    assert sched.stats["num_prefill_rows"] == 12 and sched.stats["num_shared_prefill_rows"] == 0
    assert len({tuple(r.output_ids) for r in shared}) > 3  # the samples of a group differ: their own generators
    for a, b in zip(shared, alone):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < TOL
        ref = reference_logprobs(model, a.input_ids + a.output_ids)[len(a.input_ids) - 1:]
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, ref)) < TOL


def test_greedy_and_seeded_sampling_are_reproducible(model_and_tokenizer):
    def outputs(seed, temperature):
        reqs = [make_request(i, p, temperature=temperature) for i, p in enumerate(PROMPTS)]
        run(model_and_tokenizer, reqs, random_seed=seed)
        return [r.output_ids for r in reqs]

    assert outputs(0, 0.0) == outputs(1, 0.0)
    assert outputs(7, 1.0) == outputs(7, 1.0)
    assert outputs(7, 1.0) != outputs(8, 1.0)


def test_deterministic_mode_is_batch_invariant(model_and_tokenizer):
    """With `deterministic` a request's tokens and log-probs are bit for bit those of the request served alone,
    whatever it is submitted with and in whatever order. Batched (the default) the same seeds draw the same tokens
    here, and the log-probs agree to 1e-5 (in their last bits they depend on the batch: now and then a token drawn
    near the edge between two tokens flips)."""
    def requests():
        return [make_request(i, PROMPTS[i % 4], sampling_seed=10 + i, max_new_tokens=6 + i % 3) for i in range(8)]

    alone = []
    for r in requests():
        run(model_and_tokenizer, [r])
        alone.append((r.output_ids, r.output_logprobs))
    mixed = requests()[::-1] + [make_request(100 + i, PROMPTS[i % 4], sampling_seed=500 + i) for i in range(5)]
    sched = run(model_and_tokenizer, mixed, deterministic=True, max_running_requests=64)
    assert sched.max_running_requests == 1 and not sched.shared_prefill
    assert [(r.output_ids, r.output_logprobs) for r in mixed[:8][::-1]] == alone
    batched = requests()
    run(model_and_tokenizer, batched[::-1], max_running_requests=64)
    assert [r.output_ids for r in batched] == [ids for ids, _ in alone]  # the same seeds draw the same tokens
    assert max(abs(a - b) for r, (_, lps) in zip(batched, alone) for a, b in zip(r.output_logprobs, lps)) < TOL


def test_top_k_one_and_tiny_top_p_are_greedy(model_and_tokenizer):
    greedy = make_request(0, PROMPTS[0], temperature=0.0)
    top_k = make_request(1, PROMPTS[0], temperature=0.7, top_k=1)
    top_p = make_request(2, PROMPTS[0], temperature=0.7, top_p=1e-6)
    run(model_and_tokenizer, [greedy, top_k, top_p])
    assert top_k.output_ids == greedy.output_ids == top_p.output_ids
    # the reported log-prob is the full temperature-scaled distribution's, not the truncated one's (0)
    ref = reference_logprobs(model_and_tokenizer[0], top_k.input_ids + top_k.output_ids, 0.7)
    assert max(abs(x - y) for x, y in zip(top_k.output_logprobs, ref[len(top_k.input_ids) - 1:])) < TOL
    assert all(lp < -1e-3 for lp in top_k.output_logprobs)


def test_stop_token_is_included_and_max_new_tokens_gives_length(model_and_tokenizer):
    probe = make_request(0, PROMPTS[2], temperature=0.0, max_new_tokens=8)
    run(model_and_tokenizer, [probe])
    stop_at = next(i for i, t in enumerate(probe.output_ids) if i >= 2 and t not in probe.output_ids[:i])
    stop_tok = probe.output_ids[stop_at]

    stopped = make_request(1, PROMPTS[2], temperature=0.0, max_new_tokens=8, stop_token_ids=[stop_tok],
                           ignore_eos=False)
    limited = make_request(2, PROMPTS[2], temperature=0.0, max_new_tokens=3)
    # SGLang's rule: ignore_eos turns off every token-based stop, stop_token_ids included.
    ignoring = make_request(3, PROMPTS[2], temperature=0.0, max_new_tokens=8, stop_token_ids=[stop_tok])
    run(model_and_tokenizer, [stopped, limited, ignoring])
    assert stopped.output_ids == probe.output_ids[: stop_at + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_tok}
    assert len(stopped.output_logprobs) == len(stopped.output_ids)
    assert limited.finish_reason == {"type": "length", "length": 3}
    assert limited.output_ids == probe.output_ids[:3]
    assert ignoring.finish_reason == {"type": "length", "length": 8} and ignoring.output_ids == probe.output_ids


def test_eos_from_generation_config_stops(model_and_tokenizer):
    model, tok = model_and_tokenizer
    sched = Scheduler(model, tok)
    assert {tok.eos_token_id, 0} <= sched.eos_ids  # generation_config lists <|im_end|> and <|endoftext|>
    probe = make_request(0, PROMPTS[1], temperature=0.0, max_new_tokens=4)
    run(model_and_tokenizer, [probe])
    eos_run = make_request(1, PROMPTS[1], temperature=0.0, max_new_tokens=4, ignore_eos=False)
    run(model_and_tokenizer, [eos_run], stop_token_ids={probe.output_ids[1]})
    assert eos_run.output_ids == probe.output_ids[:2] and eos_run.finish_reason["type"] == "stop"


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_scoring_with_zero_new_tokens(model_and_tokenizer, temperature):
    model = model_and_tokenizer[0]
    seq = PROMPTS[0] + PROMPTS[2]
    whole = make_request(0, seq, logprob_start_len=0, max_new_tokens=0, temperature=temperature)
    tail = make_request(1, seq, logprob_start_len=4, max_new_tokens=0, temperature=temperature)
    other = make_request(2, PROMPTS[1], temperature=0.0, max_new_tokens=5)  # shares the step, not the forward
    run(model_and_tokenizer, [whole, tail, other])
    ref = reference_logprobs(model, seq)  # prompt log-probs are the raw logits' at any temperature (SGLang's)
    assert whole.output_ids == [] and whole.finish_reason == {"type": "length", "length": 0}
    assert whole.input_logprobs[0] is None and len(whole.input_logprobs) == len(seq)
    assert max(abs(x - y) for x, y in zip(whole.input_logprobs[1:], ref)) < TOL
    assert tail.input_logprobs[0] is None and len(tail.input_logprobs) == len(seq) - 4
    assert max(abs(x - y) for x, y in zip(tail.input_logprobs[1:], ref[4:])) < TOL
    assert len(other.output_ids) == 5


def test_prefill_budgets_split_forwards_without_changing_results(model_and_tokenizer, monkeypatch):
    import slime.backends.hf_engine.scheduler as scheduler_mod

    def outputs(**kw):
        gen = [make_request(i, p, temperature=0.0, max_new_tokens=6) for i, p in enumerate(PROMPTS)]
        scored = [make_request(10 + i, p, logprob_start_len=0, max_new_tokens=0) for i, p in enumerate(PROMPTS)]
        sched = run(model_and_tokenizer, gen + scored, **kw)
        return [r.output_ids for r in gen], [r.input_logprobs for r in scored], sched.stats["num_prefill_steps"]

    gen_ref, scored_ref, steps_ref = outputs()
    monkeypatch.setattr(scheduler_mod, "MAX_FULL_LOGITS", 12 * model_and_tokenizer[0].config.vocab_size)
    gen, scored, steps = outputs(max_prefill_tokens=10)
    assert steps > steps_ref + 2 and gen == gen_ref
    for a, b in zip(scored, scored_ref):
        assert a[0] is None and b[0] is None and max(abs(x - y) for x, y in zip(a[1:], b[1:])) < TOL


def test_abort_returns_partial_output_and_spares_others(model_and_tokenizer):
    victim = make_request(0, PROMPTS[0], max_new_tokens=50)
    survivor = make_request(1, PROMPTS[1], max_new_tokens=10)
    waiting = make_request(2, PROMPTS[2], max_new_tokens=10)
    sched = Scheduler(*model_and_tokenizer, max_running_requests=2)
    for r in (victim, survivor, waiting):
        sched.submit(r)
    for _ in range(4):
        with sched.step_lock:
            sched.step()
    assert sched.abort(rid="r0") == 1
    assert sched.abort(rid="r2") == 1  # still waiting: finishes at once, with nothing generated
    assert waiting.finish_reason["type"] == "abort" and waiting.output_ids == []
    sched.run_until_idle()
    assert victim.finish_reason["type"] == "abort" and 1 <= len(victim.output_ids) < 50
    assert len(victim.output_logprobs) == len(victim.output_ids)
    assert survivor.finish_reason == {"type": "length", "length": 10}


def test_pause_keeps_requests_waiting(model_and_tokenizer):
    sched = Scheduler(*model_and_tokenizer)
    sched.pause()
    r = make_request(0, PROMPTS[0], max_new_tokens=3)
    sched.submit(r)
    sched.run_until_idle()
    assert not r.finished and sched.counts() == (0, 1)
    sched.resume()
    sched.run_until_idle()
    assert r.finish_reason == {"type": "length", "length": 3}


@pytest.mark.timeout(60)
def test_threaded_exclusive_holds_steps_and_abort_all(model_and_tokenizer):
    sched = Scheduler(*model_and_tokenizer)
    done = threading.Event()
    # far more tokens than the test's 60 s allow (max_context_len is None here: only max_new_tokens or an abort
    # ends it, ignore_eos being on), so the request still runs when the abort comes however loaded the machine is
    r = make_request(0, PROMPTS[0], max_new_tokens=10**6)
    r.on_finish = lambda _: done.set()
    sched.start()
    try:
        sched.submit(r)
        while len(r.output_ids) < 3:
            time.sleep(0.01)
        with sched.exclusive():  # what a weight update holds: no forward step may run meanwhile
            n = len(r.output_ids)
            time.sleep(0.3)
            assert len(r.output_ids) == n
        while len(r.output_ids) == n:
            time.sleep(0.01)
        sched.abort(abort_all=True)
        assert done.wait(10) and r.finish_reason["type"] == "abort"
    finally:
        sched.stop()
    assert not sched.is_alive()


def test_stop_string_and_response_text(model_and_tokenizer):
    from slime.backends.hf_engine.server import EngineState, build_response

    model, tok = model_and_tokenizer
    probe = make_request(0, PROMPTS[3], temperature=0.0, max_new_tokens=10)
    run(model_and_tokenizer, [probe])
    words = [tok.decode([t]) for t in probe.output_ids]
    k = next(i for i, w in enumerate(words) if i >= 2 and w.isalpha() and w not in "".join(words[:i]))
    sched = Scheduler(model, tok)
    state = EngineState(model, tok, sched, model_path="tiny", device="cpu", dtype="float32")
    trimmed = make_request(1, PROMPTS[3], temperature=0.0, max_new_tokens=10, stop=words[k])
    kept = make_request(2, PROMPTS[3], temperature=0.0, max_new_tokens=10, stop=[words[k]], no_stop_trim=True)
    for r in (trimmed, kept):
        sched.submit(r)
    sched.run_until_idle()
    assert trimmed.output_ids == probe.output_ids[: k + 1]
    assert trimmed.finish_reason == {"type": "stop", "matched": words[k]}
    out = build_response(trimmed, state)
    full = tok.decode(probe.output_ids[: k + 1])
    assert out["text"] == full[: full.find(words[k])] and words[k] not in out["text"]
    assert build_response(kept, state)["text"].endswith(words[k])
    assert out["meta_info"]["output_token_logprobs"][0][1] == probe.output_ids[0]


def test_sample_tokens_follows_truncated_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    n = logits.shape[0]
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(n)

    def freqs(top_p, top_k):
        toks, lps = sample_tokens(logits, ones, torch.full((n,), top_p), torch.full((n,), top_k, dtype=torch.long), u)
        assert torch.allclose(lps, logits.gather(-1, toks.unsqueeze(-1)).squeeze(-1))
        return torch.bincount(toks, minlength=4).float() / n

    assert torch.allclose(freqs(1.0, -1), torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    assert torch.allclose(freqs(0.7, -1), torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.03)  # {0.5, 0.3}
    assert torch.allclose(freqs(1.0, 3), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.03)
    greedy, _ = sample_tokens(logits[:2], torch.zeros(2), torch.ones(2), torch.full((2,), -1), None)
    assert greedy.tolist() == [0, 0]


def test_a_rows_sample_does_not_depend_on_its_batch_mates_top_p_or_top_k():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    u = torch.rand(64, generator=torch.Generator().manual_seed(2))
    ones = torch.ones(64)
    alone, _ = sample_tokens(logits, ones, ones, torch.full((64,), -1), u)  # no row truncates
    mixed_p, mixed_k = ones.clone(), torch.full((64,), -1)
    mixed_p[::2], mixed_k[1::4] = 0.5, 20  # every other row top-p, every fourth top-k
    mixed, _ = sample_tokens(logits, ones, mixed_p, mixed_k, u)
    plain = (mixed_p >= 1) & (mixed_k <= 0)
    assert plain.sum() == 16 and torch.equal(mixed[plain], alone[plain])
    assert not torch.equal(mixed[~plain], alone[~plain])  # the truncated rows do draw otherwise


def test_sampling_params_validation():
    assert SamplingParams.from_dict({"stop": "x", "top_k": 0, "unknown": 1}).stop == ["x"]
    assert SamplingParams.from_dict({"top_k": 0}).top_k == -1
    assert SamplingParams.from_dict({"n": 1, "repetition_penalty": 1.0}).top_k == -1  # "off" values pass
    for bad in ({"temperature": -1}, {"top_p": 0}, {"max_new_tokens": -2}, {"max_new_tokens": "8"}, {"n": 2},
                {"repetition_penalty": 1.1}):
        with pytest.raises(ValueError, match="sampling_params"):
            SamplingParams.from_dict(bad)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3_moe", "glm4", "glm4_moe", "deepseek_v3"])
def test_slot_cache_serves_every_tiny_architecture(tmp_path, arch):
    """The slot decode path (its own KV writes, 4-D mask, GQA-folded attention) gives the dynamic cache's
    tokens and log-probs for each architecture the tiny-model tool makes (GQA, MoE, MLA)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(str(tmp_path), arch=arch, size="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = {}
    for kv_cache in ("dynamic", "slots"):
        reqs = [make_request(i, p, temperature=0.7, sampling_seed=i, max_new_tokens=6 + i)
                for i, p in enumerate(PROMPTS)]
        sched = run((model, AutoTokenizer.from_pretrained(path)), reqs, kv_cache=kv_cache, max_running_requests=3)
        assert sched.kv_cache == kv_cache
        outputs[kv_cache] = reqs
    for d, s in zip(outputs["dynamic"], outputs["slots"]):
        assert d.output_ids == s.output_ids
        assert max(abs(x - y) for x, y in zip(d.output_logprobs, s.output_logprobs)) < TOL


def overlap_workload(model_and_tokenizer, overlap):
    """Sampled and greedy rows, top-p, stop tokens and strings, different lengths, a context limit, a scoring
    request and newcomers during decoding, stepped by hand; returns the requests and the scheduler."""
    model, tok = model_and_tokenizer
    sched = Scheduler(model, tok, kv_cache="slots", overlap=overlap, max_context_len=40)
    first = [make_request(0, PROMPTS[0], max_new_tokens=9, sampling_seed=1),
             make_request(1, PROMPTS[1], temperature=0.0, max_new_tokens=30),
             make_request(2, PROMPTS[2], max_new_tokens=3, top_p=0.9, sampling_seed=2),
             make_request(3, PROMPTS[3], max_new_tokens=60, sampling_seed=3),  # stopped by max_context_len
             make_request(4, PROMPTS[0], max_new_tokens=12, stop_token_ids=[62, 137, 92], ignore_eos=False,
                          sampling_seed=4),
             make_request(5, PROMPTS[1], max_new_tokens=14, stop=["a", "e"], sampling_seed=5)]
    later = [make_request(6, PROMPTS[2], max_new_tokens=5, sampling_seed=6),
             make_request(7, PROMPTS[3], max_new_tokens=0, logprob_start_len=0),
             make_request(8, PROMPTS[1], temperature=0.0, max_new_tokens=7)]
    for r in first:
        sched.submit(r)
    steps = 0
    while sched._has_work():
        with sched.step_lock:
            sched.step()
        steps += 1
        if steps == 4:
            for r in later:
                sched.submit(r)
    return first + later, sched


def test_overlap_schedule_gives_the_plain_schedules_tokens(model_and_tokenizer):
    plain, _ = overlap_workload(model_and_tokenizer, overlap=False)
    overlapped, sched = overlap_workload(model_and_tokenizer, overlap=True)
    assert sched.overlap and sched._in_flight is None and sched._batch is None
    for a, b in zip(plain, overlapped):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason, a.rid
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=TOL)
        assert a.input_logprobs == b.input_logprobs or max(
            abs(x - y) for x, y in zip(a.input_logprobs[1:], b.input_logprobs[1:])) < TOL
    reasons = {r.finish_reason["type"] for r in plain}
    assert reasons == {"length", "stop"} and any(r.finish_reason.get("matched") in ("a", "e") for r in plain)
    assert plain[3].finish_reason == {"type": "length", "length": 40 - len(PROMPTS[3])}
    assert sched.stats["num_generated_tokens"] == sum(len(r.output_ids) for r in overlapped)


def test_overlap_schedule_reads_a_step_after_launching_the_next(model_and_tokenizer):
    sched = Scheduler(*model_and_tokenizer, kv_cache="slots", overlap=True)
    r = make_request(0, PROMPTS[0], max_new_tokens=20)
    sched.submit(r)
    for _ in range(3):  # a prefill (its token read at once), then two decode steps
        with sched.step_lock:
            sched.step()
    assert len(r.output_ids) == 2 and sched._in_flight is not None and sched._in_flight.reqs == [r]
    with sched.exclusive():  # a weight update: the step in flight is read first, so none crosses it
        assert len(r.output_ids) == 3 and sched._in_flight is None
    sched.pause()
    assert sched._in_flight is None
    sched.resume()
    sched.run_until_idle()
    assert len(r.output_ids) == 20 and r.finish_reason == {"type": "length", "length": 20}


def test_overlap_schedule_abort_drops_the_step_in_flight(model_and_tokenizer):
    sched = Scheduler(*model_and_tokenizer, kv_cache="slots", overlap=True)
    victim, other = make_request(0, PROMPTS[0], max_new_tokens=50), make_request(1, PROMPTS[1], max_new_tokens=8)
    for r in (victim, other):
        sched.submit(r)
    for _ in range(4):
        with sched.step_lock:
            sched.step()
    sched.abort(rid="r0")
    n = len(victim.output_ids)
    sched.run_until_idle()
    assert victim.finish_reason["type"] == "abort" and len(victim.output_ids) == n
    assert len(victim.output_logprobs) == n and other.finish_reason == {"type": "length", "length": 8}
    assert sched._in_flight is None and sched._batch is None


@pytest.mark.timeout(120)
def test_overlap_schedule_serves_a_threaded_engine_through_pauses_and_weight_updates(model_and_tokenizer):
    """The worker thread with the overlap schedule while another thread submits, pauses, resumes and changes the
    weights in `exclusive()`: every request finishes with its own length and the log-probs of a full forward under
    the weights it was decoded with (the weights are changed back, so one forward checks them all)."""
    model = model_and_tokenizer[0]
    sched = Scheduler(*model_and_tokenizer, kv_cache="slots", overlap=True)
    done = []
    reqs = [make_request(i, PROMPTS[i % 4], max_new_tokens=5 + 7 * (i % 5), temperature=0.0) for i in range(16)]
    for r in reqs:
        r.on_finish = done.append
    sched.start()
    try:
        for i, r in enumerate(reqs):
            sched.submit(r)
            time.sleep(0.005)
            if i == 5:
                sched.pause()
                assert sched._in_flight is None  # nothing left in flight while paused
                sched.resume()
            if i == 10:
                with sched.exclusive():
                    assert sched._in_flight is None
                    with torch.no_grad():  # a weight update and its undo, between two steps
                        for p in model.parameters():
                            p.mul_(2.0)
                        for p in model.parameters():
                            p.div_(2.0)
        deadline = time.time() + 60
        while len(done) < len(reqs) and time.time() < deadline:
            time.sleep(0.01)
    finally:
        sched.stop()
    assert len(done) == len(reqs)
    for r in reqs:
        assert r.finish_reason == {"type": "length", "length": r.params.max_new_tokens}
        assert len(r.output_ids) == len(r.output_logprobs) == r.params.max_new_tokens
        ref = reference_logprobs(model, r.input_ids + r.output_ids)[len(r.input_ids) - 1:]
        assert max(abs(a - b) for a, b in zip(ref, r.output_logprobs)) < TOL, r.rid
