"""The adapters' wire translation: a reply echoed back by a client translates to exactly the message the trajectory
stored for it (else every turn would fork), Anthropic's mid-list system messages are folded into user ones, and a
request holding an image is refused (the adapters serve text only)."""

from __future__ import annotations

import json
import tempfile

import httpx

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter, anthropic, openai
from slime.agent.adapters.common import first_image_block, flatten_content, sampling_params, Session
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.agent.parsing import ParsedModelOutput
from tools.make_tiny_model import build_tokenizer

CALL = ParsedModelOutput(reasoning="think", text="", tool_uses=[{"name": "bash", "input": {"b": 1, "a": "x"}},
                                                                 {"name": "ls", "input": {}}])
TEXT = ParsedModelOutput(reasoning="", text="done", tool_uses=[])


def test_openai_echo_of_a_reply_matches_what_was_stored():
    for parsed in (CALL, TEXT):
        wire, stored, finish = openai.build_reply_parts(parsed, "stop")
        echoed = {k: v for k, v in wire.items() if k != "reasoning_content"}  # clients drop the reasoning
        assert openai.translate_messages([echoed]) == [stored]
    wire, stored, finish = openai.build_reply_parts(CALL, "stop")
    assert finish == "tool_calls" and wire["content"] is None and len(wire["tool_calls"]) == 1
    assert json.loads(wire["tool_calls"][0]["function"]["arguments"]) == {"a": "x", "b": 1}
    assert openai.build_reply_parts(TEXT, "length")[2] == "length"
    assert openai.arguments_as_dict("[1]") == {"_raw_arguments": "[1]"}
    assert openai.translate_messages([{"role": "developer", "content": [{"type": "text", "text": "d"}]},
                                      {"role": "tool", "tool_call_id": "c1", "content": "out"}]) == [
        {"role": "system", "content": "d"}, {"role": "tool", "content": "out"}]


def test_anthropic_echo_of_a_reply_matches_what_was_stored():
    for parsed in (CALL, TEXT):
        blocks, stop, stored = anthropic.build_reply_parts(parsed, "stop")
        assert anthropic.translate_messages([{"role": "assistant", "content": blocks}], None) == [stored]
    assert anthropic.build_reply_parts(CALL, "stop")[1] == "tool_use"
    assert anthropic.build_reply_parts(TEXT, "length")[1] == "max_tokens"
    user = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "r"}]}, {"type": "text", "text": "next"}]}
    assert anthropic.translate_messages([user], [{"type": "text", "text": "sys"}]) == [
        {"role": "system", "content": "sys"}, {"role": "tool", "content": "r"}, {"role": "user", "content": "next"}]


def test_mid_list_system_messages_fold_into_a_neighbouring_user_message():
    body = {"messages": [{"role": "system", "content": "first"}, {"role": "system", "content": "early"},
                         {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a"},
                         {"role": "system", "content": "late"}]}
    assert anthropic.fold_mid_list_system(body)
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant"]
    texts = [b["text"] for b in body["messages"][1]["content"]]
    assert texts == ["<system-reminder>\nearly\n</system-reminder>\n", "u1",
                     "<system-reminder>\nlate\n</system-reminder>\n"]
    lone = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    assert not anthropic.fold_mid_list_system(lone)


def test_sampling_params_and_content_flattening():
    sp = sampling_params(Session({"max_new_tokens": 100, "temperature": 1.0}), {"max_tokens": 7, "top_p": 0.5,
                         "stop": ["x"]}, ("max_completion_tokens", "max_tokens"), ("stop",))
    assert sp["max_new_tokens"] == 7 and sp["temperature"] == 1.0 and sp["top_p"] == 0.5 and sp["stop"] == ["x"]
    assert sp["skip_special_tokens"] is False and sp["no_stop_trim"] is True
    assert sampling_params(Session({"max_new_tokens": 5}), {"max_tokens": 70}, ("max_tokens",), ())[
        "max_new_tokens"] == 5
    assert flatten_content([{"type": "text", "text": "a"}, {"type": "image"}, "b"]) == "a\n[image omitted]\nb"


def test_image_blocks_are_found_where_clients_put_them():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    claude = {"system": [{"type": "text", "text": "s"}], "messages": [
        {"role": "user", "content": "read the screenshot"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "here"}, image]}]}]}
    assert first_image_block(claude) == ("messages[1].content[0].content[1]", "image")
    codex = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                       {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    assert first_image_block(codex) == ("messages[0].content[1]", "image_url")
    assert first_image_block({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}) is None


def test_adapters_refuse_a_request_with_an_image_instead_of_dropping_it():
    """A chat request holding an image is answered 400 naming the block, before any engine is called (the engine
    URL here points nowhere); a text request reaches the engine (and gets the adapter's 502 for the dead URL)."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = build_tokenizer(folder)
        cases = [
            (OpenAIAdapter, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is shown ?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 4},
             "messages[0].content[1] is an 'image_url' block"),
            (AnthropicAdapter, "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]},
             "messages[0].content[0].content[0] is an 'image' block"),
        ]
        for adapter_class, route, body, named in cases:
            adapter = adapter_class(tokenizer=tokenizer, sglang_url="http://127.0.0.1:9")
            handle = run_app_in_thread(adapter.app, host="127.0.0.1")
            try:
                url = f"http://127.0.0.1:{handle.port}{route}"
                refused = httpx.post(url, json=body, headers={"Authorization": "Bearer s1"}, trust_env=False)
                assert refused.status_code == 400, refused.text
                message = refused.json()["error"]["message"]
                assert named in message and "slime.rollout.multi_turn" in message
                text_only = {**body, "messages": [{"role": "user", "content": "what comes after one ?"}]}
                reached = httpx.post(url, json=text_only, headers={"Authorization": "Bearer s1"}, trust_env=False,
                                     timeout=30)
                assert reached.status_code == 502 and "engine" in reached.json()["error"]["message"]
                assert adapter.manager.turn_count("s1") == 0
            finally:
                handle.stop()
