"""Multi-turn helpers (`slime.rollout.multi_turn`).

Offline part: a 3-turn tool trajectory built with the helpers (model turns appended as the engine would
return them) equals the chat-template rendering of the whole conversation, with loss mask 1 exactly on the
model's tokens and rollout log-probs aligned (Qwen3 and Llama-3 style templates from tools/make_tiny_model.py).

Engine part: `generate_turn` / `tool_loop` against a real hf engine server process on the tiny model (the
server implements the same /generate API as the router, so the router address points at it directly; the router
itself is exercised in tests/e2e_cpu). The engine's teacher-forced log-probs of the final token sequence
must equal the rollout log-probs at every model token: that only holds if tokens and log-probs are aligned.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os

import httpx
import pytest
from transformers import AutoTokenizer

from slime.rollout import sglang_rollout
from slime.rollout.multi_turn import (
    append_model_tokens,
    append_tool_tokens,
    context_left,
    generate_turn,
    parse_tool_call_tag,
    render_tool_message,
    tool_loop,
    turn_budget_left,
)
from slime.rollout.sglang_rollout import prompt_ids
from slime.utils.http_utils import run_sync
from slime.utils.mask_utils import build_loss_mask, render_ids
from slime.utils.types import Sample
from tests.args import make_args, router_fields
from tools.make_tiny_model import build_tokenizer

PROMPT = [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": "what is one plus two ?"}]
# (assistant content, tool results that follow it); the model's end-of-turn token is appended per family
TURNS = [
    ("<think>\nadd\n</think>\n\n<tool_call>\nsearch one\n</tool_call>", ["result one"]),
    ("<think>\nthen\n</think>\n\n<tool_call>\nsearch two\n</tool_call>", ["result two", "result three"]),
    ("<think>\ncorrect\n</think>\n\nthe answer is three", []),
]
EOT = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}


def conversation() -> list[dict]:
    messages = list(PROMPT)
    for content, results in TURNS:
        messages.append({"role": "assistant", "content": content})
        messages += [{"role": "tool", "content": r} for r in results]
    return messages


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    out = {}
    for family in ("qwen3", "llama3"):
        out[family] = str(tmp_path_factory.mktemp(family))
        build_tokenizer(out[family], family)
    return out


def _namespace(checkpoint: str, url: str = "http://127.0.0.1:9", **kw) -> argparse.Namespace:
    base = {"hf_checkpoint": checkpoint, **router_fields(url), "rollout_max_context_len": None, "max_turns": None,
            "apply_chat_template_kwargs": {}}  # fmt: skip
    base.update(kw)
    return make_args(validate=False, **base)


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_helpers_rebuild_the_chat_template_rendering(family, family_dirs):
    tok = AutoTokenizer.from_pretrained(family_dirs[family])
    args = _namespace(family_dirs[family])
    sample = Sample(prompt=list(PROMPT))
    sample.tokens = prompt_ids(args, sample.prompt)
    prompt_len = len(sample.tokens)
    model_logprobs = []
    for turn, (content, results) in enumerate(TURNS):
        ids = tok(content + EOT[family], add_special_tokens=False)["input_ids"]  # what the engine returns
        lps = [-0.01 * (turn + 1) * (k + 1) for k in range(len(ids))]
        append_model_tokens(sample, ids, lps, text=content, weight_version=turn)
        model_logprobs += lps
        if results:
            appended = append_tool_tokens(sample, tok, render_tool_message(tok, results, last_token=sample.tokens[-1]))
            assert appended and sample.tokens[-len(appended) :] == appended

    messages = conversation()
    assert sample.tokens == render_ids(tok, messages)
    assert sample.response_length == len(sample.tokens) - prompt_len == len(sample.loss_mask)
    # loss mask: exactly the tokens of the assistant messages + end-of-turn, as mask_utils computes it
    _, full_mask = build_loss_mask(tok, messages)
    assert sample.loss_mask == full_mask[prompt_len:]
    assert sum(sample.loss_mask) == sum(
        len(tok(c + EOT[family], add_special_tokens=False)["input_ids"]) for c, _ in TURNS
    )
    # log-probs: one per response token, the model's where mask is 1, 0.0 at tool tokens
    assert len(sample.rollout_log_probs) == sample.response_length
    assert [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m] == model_logprobs
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)
    assert sample.weight_versions == ["0", "1", "2"]


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_render_tool_message_is_the_rendering_difference(family, family_dirs):
    # Where the template is prefix-stable, render_tool_message equals the plain difference between
    # rendering [..., assistant, tool] with the generation prompt and [..., assistant] (minus the eot).
    tok = AutoTokenizer.from_pretrained(family_dirs[family])
    before = PROMPT + [{"role": "assistant", "content": TURNS[0][0]}]
    after = before + [{"role": "tool", "content": "result one"}]
    short, long = render_ids(tok, before), render_ids(tok, after, add_generation_prompt=True)
    assert long[: len(short)] == short
    eot = tok.convert_tokens_to_ids(EOT[family])
    diff = long[len(short) :]
    got = render_tool_message(tok, "result one", last_token=eot)
    assert got == diff
    # without last_token the template's end of the assistant message is included
    assert render_tool_message(tok, "result one") == [eot] + diff


def test_render_tool_message_qwen3_thinking_off_ends_with_the_empty_think_header(family_dirs):
    tok = AutoTokenizer.from_pretrained(family_dirs["qwen3"])
    ids = render_tool_message(tok, "three", enable_thinking=False)
    assert tok.convert_ids_to_tokens(ids) == [
        "<|im_end|>", "<|im_start|>", "user", "<tool_response>", "three", "</tool_response>", "<|im_end|>",
        "<|im_start|>", "assistant", "<think>", "</think>",
    ]  # fmt: skip


def test_turn_budget_left_and_context_left(family_dirs):
    args = _namespace(family_dirs["qwen3"], max_turns=2)
    sample = Sample(prompt="one two", tokens=[5, 6, 7])
    assert turn_budget_left(args, sample, 0) and turn_budget_left(args, sample, 1)
    assert not turn_budget_left(args, sample, 2)
    assert turn_budget_left(args, sample, 5, max_turns=6)  # an explicit limit overrides --max-turns
    args.max_turns = None
    assert turn_budget_left(args, sample, 1000)
    args.rollout_max_context_len = 4
    assert context_left(args, sample) == 1 and turn_budget_left(args, sample, 0)
    sample.tokens.append(8)
    assert context_left(args, sample) == 0 and not turn_budget_left(args, sample, 0)
    # before the first turn the prompt is measured through the chat template
    fresh = Sample(prompt="one two three")
    assert context_left(args, fresh) == 4 - 3


def test_parse_tool_call_tag():
    assert parse_tool_call_tag("no call here") is None
    assert parse_tool_call_tag('a <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>') == {
        "name": "f", "arguments": {"x": 1}
    }  # fmt: skip
    assert parse_tool_call_tag("<tool_call>a</tool_call> <tool_call> b </tool_call>") == "b"


def test_append_tool_tokens_text_and_ids(family_dirs):
    tok = AutoTokenizer.from_pretrained(family_dirs["qwen3"])
    sample = Sample(tokens=[1, 2], response_length=0)
    ids = append_tool_tokens(sample, tok, "<|im_start|>user three")
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "three"]
    append_tool_tokens(sample, tok, [7])
    assert sample.tokens == [1, 2] + ids + [7]
    assert sample.loss_mask == [0, 0, 0, 0] and sample.rollout_log_probs == [0.0] * 4
    assert sample.response_length == 4


def test_helpers_extend_the_sample_lists_in_place(family_dirs):
    """A plugin may hold `sample.tokens` / `loss_mask` / `rollout_log_probs` across the helpers (slime's retool
    example keeps the loss mask and writes it back): they change those lists in place, never swap them."""
    tok = AutoTokenizer.from_pretrained(family_dirs["qwen3"])
    args = _namespace(family_dirs["qwen3"], mask_offpolicy_in_partial_rollout=True)
    sample = Sample(prompt=list(PROMPT))
    tokens = sample.tokens
    sglang_rollout.init_response(args, sample)
    prompt = prompt_ids(args, PROMPT)
    mask, log_probs = sample.loss_mask, sample.rollout_log_probs
    assert tokens is sample.tokens and tokens == prompt
    append_model_tokens(sample, [5, 6], [-0.1, -0.2], "ab", "3")
    append_tool_tokens(sample, tok, [7])
    assert (tokens, mask, log_probs) == (prompt + [5, 6, 7], [1, 1, 0], [-0.1, -0.2, 0.0])
    assert tokens is sample.tokens and mask is sample.loss_mask and log_probs is sample.rollout_log_probs

    # a resumed partial sample: the earlier tokens become context (mask 0) in the list the plugin holds; no
    # context is left, so the turn makes no request
    sample.status = Sample.Status.ABORTED
    args.rollout_max_context_len = len(sample.tokens)
    assert run_sync(generate_turn(args, sample, _params(4))) == ""
    assert mask is sample.loss_mask and mask == [0, 0, 0] and sample.status == Sample.Status.TRUNCATED


# --- against a real hf engine server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), size="tiny", seed=0)
    build_tokenizer(path, "qwen3")  # same vocabulary, the Qwen3-style chat template
    return path


@pytest.fixture(scope="module")
def engine(engine_model):
    from slime.backends.hf_engine.engine import HFEngine

    eng = HFEngine(make_args(validate=False, hf_checkpoint=engine_model, rollout_seed=1, sglang_server_concurrency=8), rank=0)
    try:
        eng.init()
        yield eng.get_url()
    finally:
        eng.shutdown()


def _params(max_new_tokens: int, **kw) -> dict:
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens, "no_stop_trim": True,
              "skip_special_tokens": False, "spaces_between_special_tokens": False}  # fmt: skip
    params.update(kw)
    return params


def _every_token(model_dir: str) -> list[int]:
    """Stop token ids covering the whole (padded) vocabulary: each turn is exactly one token, with "stop"."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return list(range(json.load(f)["vocab_size"]))


def _teacher_forced(url: str, ids: list[int]) -> list[float]:
    resp = httpx.post(url + "/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                              "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}},
                      timeout=60, trust_env=False)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return [e[0] for e in resp.json()["meta_info"]["input_token_logprobs"]]


@pytest.mark.timeout(300)
def test_generate_turn_appends_model_tokens(engine, engine_model):
    args = _namespace(engine_model, engine)
    sample = Sample(prompt=list(PROMPT))
    text = run_sync(generate_turn(args, sample, _params(6, ignore_eos=True)))
    prompt_len = len(prompt_ids(args, PROMPT))
    assert sample.response_length == len(sample.tokens) - prompt_len > 0
    assert sample.loss_mask == [1] * sample.response_length
    assert len(sample.rollout_log_probs) == sample.response_length
    assert all(lp < 0 for lp in sample.rollout_log_probs)
    assert sample.response == text and sample.weight_versions == ["default"]
    assert sample.response_length == 6 and sample.status == Sample.Status.TRUNCATED  # finish_reason "length"
    forced = _teacher_forced(engine, sample.tokens)
    for k, lp in enumerate(sample.rollout_log_probs):
        assert abs(forced[prompt_len + k] - lp) < 1e-4


@pytest.mark.timeout(300)
def test_generate_turn_respects_the_context_budget(engine, engine_model):
    prompt_len = len(prompt_ids(_namespace(engine_model), PROMPT))
    args = _namespace(engine_model, engine, rollout_max_context_len=prompt_len + 3)
    sample = Sample(prompt=list(PROMPT))
    run_sync(generate_turn(args, sample, _params(8, ignore_eos=True)))
    assert len(sample.tokens) == prompt_len + 3 and sample.status == Sample.Status.TRUNCATED
    before = list(sample.tokens)
    args.sglang_router_port = 9  # nothing left: no request is made (it would fail)
    assert run_sync(generate_turn(args, sample, _params(8))) == ""
    assert sample.tokens == before and sample.status == Sample.Status.TRUNCATED


def test_generate_turn_aborted_rollout_makes_no_request(family_dirs):
    args = _namespace(family_dirs["qwen3"])  # the router address points nowhere

    async def aborted_turn(sample):
        event = asyncio.Event()
        event.set()
        token = sglang_rollout._abort_event.set(event)
        try:
            return await generate_turn(args, sample, _params(4))
        finally:
            sglang_rollout._abort_event.reset(token)

    sample = Sample(prompt=list(PROMPT))
    assert run_sync(aborted_turn(sample)) == ""
    assert sample.status == Sample.Status.ABORTED and sample.response_length == 0


@pytest.mark.timeout(300)
def test_tool_loop_three_turns_aligned_with_the_engine(engine, engine_model):
    tok = AutoTokenizer.from_pretrained(engine_model)
    args = _namespace(engine_model, engine, max_turns=3)
    calls = []

    def call_tool(call):
        calls.append(call)
        return f"result {['one', 'two', 'three'][len(calls) - 1]}"

    sample = Sample(prompt=list(PROMPT))
    params = _params(4, stop_token_ids=_every_token(engine_model))
    run_sync(tool_loop(args, sample, params, call_tool=call_tool, parse_call=lambda text: "call"))
    prompt_len = len(prompt_ids(args, PROMPT))

    # three model turns of one token each; the model still "called" after the last one: TRUNCATED, no 3rd call
    assert sample.metadata["turns"] == 3 and sample.metadata["tool_calls"] == 2 and len(calls) == 2
    assert sample.status == Sample.Status.TRUNCATED
    assert sum(sample.loss_mask) == 3 and sample.loss_mask[0] == 1 and sample.loss_mask[-1] == 1
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert sample.response_length == len(sample.tokens) - prompt_len
    assert sample.weight_versions == ["default"] * 3

    # the environment tokens are exactly the rendered tool messages (+ next assistant header)
    response = sample.tokens[prompt_len:]
    positions = [k for k, m in enumerate(sample.loss_mask) if m]
    for n, (a, b) in enumerate(itertools.pairwise(positions)):
        result = f"result {['one', 'two'][n]}"
        assert response[a + 1 : b] == render_tool_message(tok, result, last_token=response[a])
        assert tok.convert_ids_to_tokens(response[b - 2 : b]) == ["<|im_start|>", "assistant"]

    # the engine scoring the whole trajectory agrees with the rollout log-probs at every model token
    forced = _teacher_forced(engine, sample.tokens)
    for k in positions:
        assert sample.rollout_log_probs[k] < 0
        assert abs(forced[prompt_len + k] - sample.rollout_log_probs[k]) < 1e-4
    assert all(sample.rollout_log_probs[k] == 0.0 for k in range(sample.response_length) if k not in positions)


@pytest.mark.timeout(300)
def test_tool_loop_stops_when_the_tool_result_does_not_fit(engine, engine_model):
    args = _namespace(engine_model, engine)
    prompt_len = len(prompt_ids(args, PROMPT))
    args.rollout_max_context_len = prompt_len + 6
    sample = Sample(prompt=list(PROMPT))
    params = _params(4, stop_token_ids=_every_token(engine_model))
    run_sync(tool_loop(args, sample, params, call_tool=lambda c: "result " * 20, parse_call=lambda t: "call"))
    assert sample.status == Sample.Status.TRUNCATED
    assert sample.metadata == {"turns": 1, "tool_calls": 0}
    assert sample.response_length == 1 and len(sample.tokens) == prompt_len + 1


@pytest.mark.timeout(300)
def test_tool_loop_ends_on_an_answer_without_a_call(engine, engine_model):
    args = _namespace(engine_model, engine)
    sample = Sample(prompt=list(PROMPT))
    params = _params(4, stop_token_ids=_every_token(engine_model))
    run_sync(tool_loop(args, sample, params, call_tool=lambda c: pytest.fail("no call expected"),
                       parse_call=lambda t: None))  # fmt: skip
    assert sample.status == Sample.Status.COMPLETED
    assert sample.metadata == {"turns": 1, "tool_calls": 0} and sample.loss_mask == [1]
