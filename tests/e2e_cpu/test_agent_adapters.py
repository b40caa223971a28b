"""slime.agent.adapters against a real hf engine (with an engine key) behind the real sglang-router, called over
HTTP the way agent CLIs call them: OpenAI-style /v1/chat/completions (Codex) and Anthropic-style /v1/messages
(Claude Code, streamed). The recorded trajectory must hold exactly the engine's tokens and log-probs, with the
loss on the model's tokens only; the engine's answers are checked by asking it directly with the same prompt."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.agent.parsing import require_sglang_parsers
from slime.backends.hf_engine.engine import HFEngine
from slime.rollout.router import RouterProcess
from slime.utils import http_utils
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample
from tests.args import make_args

KEY = "agent-test-key-0123456789abcdef"
SAMPLING = {"temperature": 0.0, "max_new_tokens": 6}  # greedy: the direct call must reproduce the adapter's


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    """(router url, tokenizer): one keyed engine registered with a keyed router; slime's http_utils trusts it."""
    engine = HFEngine(make_args("--engine-api-key", KEY, hf_checkpoint=tiny_model_dir, sglang_server_concurrency=4),
                      0)
    router = RouterProcess("127.0.0.1", None, log_dir=str(tmp_path_factory.mktemp("router")), api_key=KEY)
    try:
        engine.init()
        router.start()
        router.add_worker(engine.get_url())
        http_utils.set_engine_api_key(KEY)
        http_utils.trust_engine_url(router.url)
        yield router.url, load_tokenizer(tiny_model_dir)
    finally:
        http_utils.set_engine_api_key(None)
        router.stop()
        engine.shutdown()


def _direct(url: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """The engine's own answer for `prompt_ids` (through the router, with the key)."""
    sp = {**SAMPLING, "max_new_tokens": max_new_tokens, "skip_special_tokens": False, "no_stop_trim": True}
    r = httpx.post(f"{url}/generate", json={"input_ids": prompt_ids, "sampling_params": sp, "return_logprob": True},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60, trust_env=False)
    r.raise_for_status()
    pairs = r.json()["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], [p[0] for p in pairs]


def _render(tok, messages, tools=None) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def _check_rows(rows: list[Sample], turns: list[tuple[list[int], list[int], list[float]]], reward: float) -> None:
    """One row: the first prompt, the first output (trained, the engine's log-probs), the second prompt's new
    tokens (loss 0), the second output (trained). The second prompt must extend the first turn's tokens exactly:
    the outputs are capped before the model's end token, so the echoed text re-renders to the same ids."""
    (p1, o1, l1), (p2, o2, l2) = turns
    assert p2[:len(p1) + len(o1)] == p1 + o1, "premise: the second prompt extends the first turn token for token"
    new = len(p2) - len(p1) - len(o1)
    [row] = rows
    assert row.tokens == p2 + o2 and row.response_length == len(o1) + new + len(o2)
    assert row.loss_mask == [1] * len(o1) + [0] * new + [1] * len(o2)
    assert row.rollout_log_probs == pytest.approx(l1 + [0.0] * new + l2, abs=1e-6)
    assert row.reward == reward and row.status == Sample.Status.COMPLETED


def _serve(adapter):
    return run_app_in_thread(adapter.app, host="127.0.0.1", thread_name="test-adapter")


@pytest.mark.timeout(180)
def test_openai_chat_completions_turns_become_the_engines_tokens(stack):
    url, tok = stack
    adapter = OpenAIAdapter(tokenizer=tok, sglang_url=url)
    handle = _serve(adapter)
    try:
        base = f"http://127.0.0.1:{handle.port}"
        adapter.open_session("codex-1", sampling_defaults=dict(SAMPLING))
        auth = {"Authorization": "Bearer codex-1"}
        tools = [{"type": "function", "function": {"name": "shell", "description": "run a command",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        history = [{"role": "system", "content": "you are a helper"}, {"role": "user", "content": "what is 2 + 3"}]
        r1 = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=60, trust_env=False,
                        json={"model": "m", "messages": history, "tools": tools, "max_tokens": 4})
        assert r1.status_code == 200, r1.text
        a1 = r1.json()["choices"][0]["message"]
        assert a1["role"] == "assistant" and r1.json()["usage"]["completion_tokens"] >= 1
        history2 = history + [a1, {"role": "user", "content": "and 4 + 4"}]
        r2 = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=60, trust_env=False,
                        json={"model": "m", "messages": history2, "tools": tools, "max_completion_tokens": 5,
                              "stream": True})
        assert r2.status_code == 200 and r2.text.rstrip().endswith("data: [DONE]"), r2.text
        chunks = [json.loads(line[6:]) for line in r2.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert adapter.manager.turn_count("codex-1") == 2

        chat_tools = [{"type": "function", "function": {**tools[0]["function"]}}]
        p1 = _render(tok, history, chat_tools)
        echoed = {"role": "assistant", "content": a1["content"] or ""}
        p2 = _render(tok, history + [echoed, history2[-1]], chat_tools)
        turns = [(p1, *_direct(url, p1, 4)), (p2, *_direct(url, p2, 5))]
        assert r1.json()["usage"]["completion_tokens"] == len(turns[0][1])
        assert chunks[-1]["usage"]["completion_tokens"] == len(turns[1][1])
        rows = asyncio.run(adapter.finish_session("codex-1", base_sample=Sample(index=3, group_index=1), reward=1.0))
        _check_rows(rows, turns, 1.0)
        assert rows[-1].response == tok.decode(rows[-1].tokens[-rows[-1].response_length:], skip_special_tokens=False)
        # a closed session refuses stragglers
        late = httpx.post(f"{base}/v1/chat/completions", headers=auth, json={"messages": history}, trust_env=False)
        assert late.status_code == 503

        # a prompt that already fills the session's context budget ends the turn without calling the engine
        adapter.open_session("small", sampling_defaults=dict(SAMPLING), max_context_tokens=len(p1))
        full = httpx.post(f"{base}/v1/chat/completions", json={"messages": history, "tools": tools, "user": "small"},
                          timeout=60, trust_env=False).json()
        assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 0
        assert adapter.manager.turn_count("small") == 1
        assert asyncio.run(adapter.finish_session("small", base_sample=Sample(index=0))) == []  # nothing to train
    finally:
        handle.stop()


@pytest.mark.timeout(180)
def test_anthropic_messages_streamed_turns_become_the_engines_tokens(stack):
    url, tok = stack
    adapter = AnthropicAdapter(tokenizer=tok, sglang_url=url, max_turns_per_sid=2)
    handle = _serve(adapter)
    try:
        base = f"http://127.0.0.1:{handle.port}"
        adapter.open_session("cc-1", sampling_defaults=dict(SAMPLING))
        auth = {"Authorization": "Bearer cc-1", "anthropic-version": "2023-06-01"}
        assert httpx.post(f"{base}/v1/messages/count_tokens", headers=auth, json={}).json() == {"input_tokens": 0}
        msgs = [{"role": "user", "content": [{"type": "text", "text": "list the files"}]}]
        body = {"model": "m", "system": "you are a coder", "max_tokens": 5, "stream": True, "messages": msgs}
        r1 = httpx.post(f"{base}/v1/messages", headers=auth, json=body, timeout=60, trust_env=False)
        assert r1.status_code == 200 and r1.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r1.text.splitlines() if line.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        out_tokens = events[-2]["usage"]["output_tokens"]

        msgs2 = msgs + [{"role": "assistant", "content": [{"type": "text", "text": text}]},
                        {"role": "user", "content": [{"type": "text", "text": "now read it"}]}]
        r2 = httpx.post(f"{base}/v1/messages", headers={"X-Api-Key": "cc-1"}, timeout=60, trust_env=False,
                        json={**body, "stream": False, "max_tokens": 3, "messages": msgs2})
        assert r2.status_code == 200 and r2.json()["type"] == "message", r2.text
        assert r2.json()["stop_reason"] in ("end_turn", "max_tokens")
        capped = httpx.post(f"{base}/v1/messages", headers=auth, json={**body, "stream": False}, trust_env=False)
        assert capped.status_code == 429 and "max_turns_per_sid=2" in capped.json()["error"]["message"]

        system = {"role": "system", "content": "you are a coder"}
        p1 = _render(tok, [system, {"role": "user", "content": "list the files"}])
        p2 = _render(tok, [system, {"role": "user", "content": "list the files"},
                           {"role": "assistant", "content": text}, {"role": "user", "content": "now read it"}])
        turns = [(p1, *_direct(url, p1, 5)), (p2, *_direct(url, p2, 3))]
        assert out_tokens == len(turns[0][1])
        rows = asyncio.run(adapter.finish_session("cc-1", base_sample=Sample(index=0), reward=0.5))
        _check_rows(rows, turns, 0.5)
    finally:
        handle.stop()


@pytest.mark.timeout(60)
def test_an_engine_that_refuses_is_a_502_naming_it_and_missing_parsers_refuse_at_start(stack):
    url, tok = stack
    http_utils.set_engine_api_key("wrong-key")  # the router answers 401 to every /generate
    adapter = OpenAIAdapter(tokenizer=tok, sglang_url=url)
    handle = _serve(adapter)
    try:
        r = httpx.post(f"http://127.0.0.1:{handle.port}/v1/chat/completions", trust_env=False, timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "user": "s"})
        assert r.status_code == 502 and f"{url}/generate" in r.json()["error"]["message"] and "401" in r.text
        assert not adapter.manager.has_session("s")
        try:
            require_sglang_parsers()
        except ImportError:
            with pytest.raises(ImportError, match="pip install sglang"):
                OpenAIAdapter(tokenizer=tok, sglang_url=url, tool_parser="qwen25")
    finally:
        http_utils.set_engine_api_key(KEY)
        handle.stop()
