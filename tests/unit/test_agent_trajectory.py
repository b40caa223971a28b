"""slime.agent.trajectory and slime.agent.parsing: how an agent's turns become training rows, closed form."""

from __future__ import annotations

import pytest

from slime.agent import parsing
from slime.agent.parsing import parse_model_output, parse_xml_tool_uses
from slime.agent.trajectory import TrajectoryManager, TurnRecord
from slime.utils.types import Sample

SYS = {"role": "system", "content": "s"}
USER = {"role": "user", "content": "u"}


def _turn(prompt, out, finish="stop"):
    return TurnRecord(prompt_ids=list(prompt), output_ids=list(out), finish_reason=finish,
                      output_log_probs=[-0.1 * (i + 1) for i in range(len(out))])


def _asst(text, **kw):
    return {"role": "assistant", "content": text, **kw}


def test_two_clean_turns_make_one_row_with_only_the_outputs_trained():
    m = TrajectoryManager()
    m.record_turn("a", turn=_turn([1, 2, 3], [10, 11]), prompt_messages=[SYS, USER], response_message=_asst("x"))
    tool = {"role": "tool", "content": "r"}
    m.record_turn("a", turn=_turn([1, 2, 3, 10, 11, 4, 5], [12]), prompt_messages=[SYS, USER, _asst("x"), tool],
                  response_message=_asst("y"))
    assert m.turn_count("a") == 2
    [s] = m.get_trajectory("a", base_sample=Sample(index=7, group_index=2, prompt="p"), reward=1.5,
                           extra_metadata={"k": 1})
    assert s.tokens == [1, 2, 3, 10, 11, 4, 5, 12]
    assert s.response_length == 5 and s.loss_mask == [1, 1, 0, 0, 1]
    assert s.rollout_log_probs == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.1])
    assert (s.index, s.group_index, s.rollout_id, s.reward, s.status) == (7, 2, 7, 1.5, Sample.Status.COMPLETED)
    assert s.metadata == {"k": 1, "truncated": False, "use_tool": False, "ill_formed": False}
    assert m.get_trajectory("a", base_sample=Sample()) == [] and not m.has_session("a")


def test_drift_inside_the_last_short_response_is_realigned_with_loss_zero():
    m = TrajectoryManager(fork_threshold_tokens=4)
    m.record_turn("a", turn=_turn([1, 2], [10, 11, 12]), prompt_messages=[USER], response_message=_asst("x"))
    # the template re-renders the response as 10, 99 (12 dropped), then the new user turn 5
    m.record_turn("a", turn=_turn([1, 2, 10, 99, 5], [13, 14], finish="length"),
                  prompt_messages=[USER, _asst("x"), USER], response_message=_asst("z"))
    [s] = m.get_trajectory("a", base_sample=Sample(index=0))
    assert s.tokens == [1, 2, 10, 99, 5, 13, 14]
    assert s.loss_mask == [0, 0, 0, 1, 1]  # the first response lost its training signal
    assert s.rollout_log_probs == pytest.approx([0, 0, 0, -0.1, -0.2])
    assert s.metadata["truncated"] is True


def test_drift_before_the_last_response_or_a_long_output_forks_into_two_rows():
    for prompt2, out2, threshold in (([1, 7, 10, 5], [13], 100), ([1, 2, 10, 99, 5], [13, 14, 15], 3)):
        m = TrajectoryManager(fork_threshold_tokens=threshold)
        m.record_turn("a", turn=_turn([1, 2], [10, 11]), prompt_messages=[USER], response_message=_asst("x"))
        m.record_turn("a", turn=_turn(prompt2, out2), prompt_messages=[USER, _asst("x"), USER],
                      response_message=_asst("z"))
        first, second = m.get_trajectory("a", base_sample=Sample(index=0))
        assert (first.tokens, first.loss_mask) == ([1, 2, 10, 11], [1, 1])
        assert second.tokens == prompt2 + out2 and second.loss_mask == [1] * len(out2)


def test_a_sub_agent_branch_is_its_own_row_and_a_shared_turn_trains_once():
    m = TrajectoryManager()
    m.record_turn("a", turn=_turn([1], [10]), prompt_messages=[SYS, USER], response_message=_asst("x"))
    m.record_turn("a", turn=_turn([1, 10, 2], [11]), prompt_messages=[SYS, USER, _asst("x"), USER],
                  response_message=_asst("y"))
    other_user = {"role": "user", "content": "v"}
    m.record_turn("a", turn=_turn([1, 10, 3], [12]), prompt_messages=[SYS, USER, _asst("x"), other_user],
                  response_message=_asst("w"))
    sub = {"role": "system", "content": "sub-agent"}
    m.record_turn("a", turn=_turn([50], [51]), prompt_messages=[sub, USER], response_message=_asst("q"))
    rows = m.get_trajectory("a", base_sample=Sample(index=0))
    assert [(r.tokens, r.loss_mask) for r in rows] == [
        ([1, 10, 2, 11], [1, 0, 1]),
        ([1, 10, 3, 12], [0, 0, 1]),  # the shared first response is context here
        ([50, 51], [1]),
    ]


def test_a_replayed_rewrite_of_a_short_response_replaces_it_instead_of_training_it_twice():
    m = TrajectoryManager()
    m.record_turn("a", turn=_turn([1], [10, 11]), prompt_messages=[USER], response_message=_asst("x "))
    m.record_turn("a", turn=_turn([1, 10, 2], [12]), prompt_messages=[USER, _asst("x"), USER],
                  response_message=_asst("y"))
    [s] = m.get_trajectory("a", base_sample=Sample(index=0))  # no dead-end row for the abandoned response
    assert s.tokens == [1, 10, 2, 12] and s.loss_mask == [1]  # it is now part of the prompt


def test_tool_use_metadata_truncation_and_bad_log_probs():
    m = TrajectoryManager()
    call = [{"type": "function", "function": {"name": "ls", "arguments": {}}}]
    m.record_turn("a", turn=_turn([1, 2], [3, 4, 5]), prompt_messages=[USER],
                  response_message=_asst("", tool_calls=call))
    [s] = m.get_trajectory("a", base_sample=Sample(index=0), max_sample_tokens=4)
    assert s.tokens == [1, 2, 3, 4] and s.loss_mask == [1, 1] and s.response_length == 2
    assert s.metadata["use_tool"] is True
    with pytest.raises(ValueError, match="output_log_probs has 2 entries for 1 output tokens"):
        m.record_turn("b", turn=TurnRecord([1], [2], "stop", [0.1, 0.2]), prompt_messages=[USER],
                      response_message=None)
    m.record_turn("c", turn=_turn([1], [2]), prompt_messages=[], response_message=None)
    assert not m.has_session("c")


def test_xml_tool_calls_of_declared_tools_are_parsed():
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    text = ("ok <tool_call><function=bash><parameter=cmd> ls -la </parameter></function></tool_call>"
            "<tool_call><function=rm><parameter=x>1</parameter></function></tool_call>")
    rest, uses = parse_xml_tool_uses(text, tools)
    assert uses == [{"name": "bash", "input": {"cmd": "ls -la"}}]
    assert rest == "ok <tool_call><function=rm><parameter=x>1</parameter></function></tool_call>"
    parsed = parse_model_output(text, tools_schema=tools, tool_parser_name=None, reasoning_parser_name=None)
    assert parsed.tool_uses == uses and parsed.reasoning == "" and not parsed.ill_formed
    # without declared tools nothing is parsed out
    assert parse_model_output(text, tools_schema=None, tool_parser_name=None,
                              reasoning_parser_name=None).tool_uses == []


def test_a_parser_name_without_sglang_parsers_names_what_to_install():
    try:
        parsing.require_sglang_parsers()
    except ImportError:
        with pytest.raises(ImportError, match="pip install sglang"):
            parse_model_output("<think>a</think>b", tools_schema=None, tool_parser_name=None,
                               reasoning_parser_name="qwen3")
    else:
        parsed = parse_model_output("a</think>b", tools_schema=None, tool_parser_name=None,
                                    reasoning_parser_name="qwen3")
        assert (parsed.reasoning, parsed.text) == ("a", "b")


def test_a_sample_with_images_is_refused_instead_of_its_images_dropped():
    manager = TrajectoryManager()
    manager.record_turn("s", turn=_turn([1, 2], [3, 4]), prompt_messages=[{"role": "user", "content": "u"}],
                        response_message=_asst("a"))
    with_images = Sample(index=7, prompt="p", multimodal_inputs={"images": ["img"]})
    with pytest.raises(ValueError, match="sample 7 has 1 image.*--multimodal-keys.*slime.rollout.multi_turn"):
        manager.get_trajectory("s", base_sample=with_images)
    assert len(manager.get_trajectory("s", base_sample=Sample(index=7, prompt="p"))) == 1
