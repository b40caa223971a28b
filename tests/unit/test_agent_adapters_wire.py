"""The adapters' wire translation: a reply echoed back by a client translates to exactly the message the trajectory
stored for it (else every turn would fork), and Anthropic's mid-list system messages are folded into user ones."""

from __future__ import annotations

import json

from slime.agent.adapters import anthropic, openai
from slime.agent.adapters.common import flatten_content, sampling_params, Session
from slime.agent.parsing import ParsedModelOutput

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
