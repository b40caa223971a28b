"""Loss masks of multi-turn chat data (`slime.utils.mask_utils`) on offline tokenizers with Qwen3, GLM-4 and
Llama-3 style chat templates (tools/make_tiny_model.py CHAT_TEMPLATES; the word-level tokenizer drops
whitespace, so expected spans below are lists of tokens). slime's loss-mask types (`--loss-mask-type`) are
checked token by token on those tokenizers with a newline token added (as Qwen's tokenizers have one), and on a
Qwen2.5-style template that puts a default system prompt before a lone message."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from slime.utils.mask_utils import (
    ChatTemplatePrefixError,
    MultiTurnLossMaskGenerator,
    build_loss_mask,
    get_response_lengths,
    render_ids,
)
from tools.make_tiny_model import build_tokenizer

TRAJECTORY = [
    {"role": "system", "content": "you are helpful"},
    {"role": "user", "content": "what is one plus two ?"},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\n<tool_call>\nsearch one\n</tool_call>"},
    {"role": "tool", "content": "result one"},
    {"role": "assistant", "content": "<think>\nthen\n</think>\n\n<tool_call>\nsearch two\n</tool_call>"},
    {"role": "tool", "content": "result two"},
    {"role": "assistant", "content": "<think>\ncorrect\n</think>\n\nthe answer is three"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for family in ("qwen3", "glm4", "llama3"):
        path = str(tmp_path_factory.mktemp(family))
        build_tokenizer(path, family)
        out[family] = AutoTokenizer.from_pretrained(path)
    return out


def spans(tok, ids, mask):
    """Runs of consecutive masked tokens, as token strings."""
    out, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            out.append(tok.convert_ids_to_tokens(cur))
            cur = []
    if cur:
        out.append(tok.convert_ids_to_tokens(cur))
    return out


CALL1 = ["<tool_call>", "search", "one", "</tool_call>"]
CALL2 = ["<tool_call>", "search", "two", "</tool_call>"]
ANSWER = ["the", "answer", "is", "three"]


def test_qwen3_thinking_masks_assistant_content_and_im_end(tokenizers):
    tok = tokenizers["qwen3"]
    ids, mask = build_loss_mask(tok, TRAJECTORY)
    assert ids == render_ids(tok, TRAJECTORY)
    assert len(mask) == len(ids)
    assert spans(tok, ids, mask) == [
        ["<think>", "add", "</think>"] + CALL1 + ["<|im_end|>"],
        ["<think>", "then", "</think>"] + CALL2 + ["<|im_end|>"],
        ["<think>", "correct", "</think>"] + ANSWER + ["<|im_end|>"],
    ]
    # role headers are not trained on
    toks = tok.convert_ids_to_tokens(ids)
    for k, t in enumerate(toks):
        if t == "<|im_start|>":
            assert mask[k] == 0 and mask[k + 1] == 0


def test_qwen3_thinking_on_without_reasoning_trains_the_empty_think_block(tokenizers):
    # In thinking mode the model writes the (empty) think block itself, so it is part of the target.
    tok = tokenizers["qwen3"]
    messages = [{"role": "user", "content": "one plus two ?"}, {"role": "assistant", "content": "three"}]
    ids, mask = build_loss_mask(tok, messages)
    assert spans(tok, ids, mask) == [["<think>", "</think>", "three", "<|im_end|>"]]


def test_qwen3_thinking_off_masks_the_prompted_think_block(tokenizers):
    tok = tokenizers["qwen3"]
    messages = [{"role": "user", "content": "one plus two ?"}, {"role": "assistant", "content": "three"}]
    ids, mask = build_loss_mask(tok, messages, enable_thinking=False)
    assert ids == render_ids(tok, messages, enable_thinking=False)
    assert spans(tok, ids, mask) == [["three", "<|im_end|>"]]
    assert tok.convert_ids_to_tokens(ids)[-5:] == ["assistant", "<think>", "</think>", "three", "<|im_end|>"]


def test_qwen3_thinking_off_multi_turn_breaks_the_prefix_assumption(tokenizers):
    # Qwen3 renders the empty think block only on the last assistant message: the rendering of the first
    # assistant turn is not a prefix of the full conversation; the error says where.
    tok = tokenizers["qwen3"]
    messages = [
        {"role": "user", "content": "one plus two ?"},
        {"role": "assistant", "content": "<tool_call>\nsearch\n</tool_call>"},
        {"role": "tool", "content": "three"},
        {"role": "assistant", "content": "three"},
    ]
    with pytest.raises(ChatTemplatePrefixError, match=r"messages\[:2\] \(message 1\)") as e:
        build_loss_mask(tok, messages, enable_thinking=False)
    assert "chat template of" in str(e.value) and "first difference at token" in str(e.value)


def test_qwen3_dropped_reasoning_of_an_earlier_query_is_detected(tokenizers):
    tok = tokenizers["qwen3"]
    messages = [
        {"role": "user", "content": "one ?"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\none"},
        {"role": "user", "content": "two ?"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\ntwo"},
    ]
    with pytest.raises(ChatTemplatePrefixError, match=r"messages\[:2\] \(message 1\)"):
        build_loss_mask(tok, messages)


def test_glm4_masks_content_and_the_next_role_token_the_model_stops_with(tokenizers):
    tok = tokenizers["glm4"]
    messages = [TRAJECTORY[1]] + [dict(m, content=m["content"].split("</think>")[-1]) for m in TRAJECTORY[2:]]
    ids, mask = build_loss_mask(tok, messages)
    assert ids == render_ids(tok, messages)
    # "\n" after <|assistant|> is generated by the model but the word-level tokenizer has no token for it
    assert spans(tok, ids, mask) == [CALL1 + ["<|observation|>"], CALL2 + ["<|observation|>"], ANSWER]
    toks = tok.convert_ids_to_tokens(ids)
    assert all(m == 0 for t, m in zip(toks, mask) if t == "<|assistant|>")


def test_glm4_user_token_after_an_answer_is_the_stop_token(tokenizers):
    tok = tokenizers["glm4"]
    messages = [
        {"role": "user", "content": "one ?"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "two ?"},
        {"role": "assistant", "content": "two"},
    ]
    ids, mask = build_loss_mask(tok, messages)
    assert spans(tok, ids, mask) == [["one", "<|user|>"], ["two"]]


def test_llama3_masks_content_and_eot(tokenizers):
    tok = tokenizers["llama3"]
    ids, mask = build_loss_mask(tok, TRAJECTORY)
    assert ids == render_ids(tok, TRAJECTORY)
    assert spans(tok, ids, mask) == [
        ["<think>", "add", "</think>"] + CALL1 + ["<|eot_id|>"],
        ["<think>", "then", "</think>"] + CALL2 + ["<|eot_id|>"],
        ["<think>", "correct", "</think>"] + ANSWER + ["<|eot_id|>"],
    ]
    toks = tok.convert_ids_to_tokens(ids)
    assert toks[0] == "<|begin_of_text|>" and mask[0] == 0
    assert all(m == 0 for t, m in zip(toks, mask) if t in ("<|start_header_id|>", "<|end_header_id|>", "assistant"))


def test_template_whose_prefix_changes_is_rejected_with_tokenizer_and_index(tokenizers, tmp_path):
    build_tokenizer(str(tmp_path), "qwen3")
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    # a template that writes the number of messages up front: no prefix of it is stable
    tok.chat_template = (
        "{{- messages | length }}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + ' ' + m['content'] "
        "+ '<|im_end|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant' }}{%- endif %}"
    )
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    with pytest.raises(ChatTemplatePrefixError) as e:
        build_loss_mask(tok, messages)
    msg = str(e.value)
    assert str(tmp_path) in msg and "chat_template sha1" in msg and "(message 1)" in msg


def test_generator_wrapper_and_text_spans(tokenizers):
    gen = MultiTurnLossMaskGenerator(tokenizers["llama3"], tokenizer_type=None)  # None: build_loss_mask
    ids, mask = gen.get_loss_mask(TRAJECTORY[:3])
    assert gen.get_text_from_loss_mask(ids, mask) == [tokenizers["llama3"].decode(
        tokenizers["llama3"].convert_tokens_to_ids(["<think>", "add", "</think>"] + CALL1 + ["<|eot_id|>"]))]


# ---- slime's loss-mask types -------------------------------------------------------------------------------
SFT_CONVERSATION = [
    {"role": "system", "content": "you are helpful"},
    {"role": "user", "content": "what is one plus two ?"},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\n<tool_call>\nsearch one\n</tool_call>"},
    {"role": "tool", "content": "result one"},
    {"role": "tool", "content": "result two"},
    {"role": "assistant", "content": "three"},
]
PROMPT = ("<|im_start|> system NL you are helpful <|im_end|> NL <|im_start|> user NL what is one plus two ? "
          "<|im_end|> NL")
FIRST_TURN = "<|im_start|> assistant NL [<think>] [NL] [add] [NL] [</think>] [NL] [NL] [<tool_call>] [NL] [search] " \
             "[one] [NL] [</tool_call>] [<|im_end|>] [NL]"
# Qwen2.5 style: a default system prompt unless the conversation starts with one
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nyou are a helpful math tutor<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if not (m.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def newline_tokenizers(tmp_path_factory):
    """The default (Qwen-style) and Qwen3 test tokenizers with a newline token, and a Qwen2.5-style one."""
    out = {}
    for family, template in (("default", None), ("qwen3", None), ("qwen25", QWEN25_TEMPLATE)):
        path = str(tmp_path_factory.mktemp(family))
        build_tokenizer(path, "default" if family == "qwen25" else family)
        tok = AutoTokenizer.from_pretrained(path)
        tok.add_tokens(["\n"])
        if template:
            tok.chat_template = template
        out[family] = tok
    return out


def marked(tok, ids, mask) -> str:
    """The tokens, trained ones in brackets, the newline as NL."""
    names = [t.replace("\n", "NL") for t in tok.convert_ids_to_tokens(ids)]
    return " ".join(f"[{t}]" if m else t for t, m in zip(names, mask, strict=True))


def test_qwen3_type_trains_each_assistant_turn_after_its_header(newline_tokenizers):
    tok = newline_tokenizers["qwen3"]
    ids, mask = MultiTurnLossMaskGenerator(tok, "qwen3").get_loss_mask(SFT_CONVERSATION)
    assert marked(tok, ids, mask) == " ".join([
        PROMPT, FIRST_TURN,
        # consecutive tool results: one user turn, as the template renders them
        "<|im_start|> user NL <tool_response> NL result one NL </tool_response> NL <tool_response> NL result two NL "
        "</tool_response> <|im_end|> NL",
        # the last turn has no reasoning: the template's empty think block is part of what the model writes
        "<|im_start|> assistant NL [<think>] [NL] [NL] [</think>] [NL] [NL] [three] [<|im_end|>] [NL]",
    ])
    assert ids == render_ids(tok, SFT_CONVERSATION)  # here the turns render as inside the conversation


def test_qwen_type_renders_each_message_alone(newline_tokenizers):
    tok = newline_tokenizers["qwen3"]
    ids, mask = MultiTurnLossMaskGenerator(tok, "qwen").get_loss_mask(SFT_CONVERSATION)
    # each tool result is a user turn of its own (rendered alone), unlike in the conversation's rendering
    assert marked(tok, ids, mask) == " ".join([
        PROMPT, FIRST_TURN,
        "<|im_start|> user NL <tool_response> NL result one NL </tool_response> <|im_end|> NL",
        "<|im_start|> user NL <tool_response> NL result two NL </tool_response> <|im_end|> NL",
        "<|im_start|> assistant NL [<think>] [NL] [NL] [</think>] [NL] [NL] [three] [<|im_end|>] [NL]",
    ])


def test_qwen_type_cuts_the_default_system_prompt_of_lone_messages(newline_tokenizers):
    tok = newline_tokenizers["qwen25"]
    gen = MultiTurnLossMaskGenerator(tok, "qwen")
    assert (gen.system_message_length, gen.gen_token_length) == (11, 3)  # "<|im_start|> system NL ... NL"; header
    messages = [{"role": "user", "content": "one plus two ?"}, {"role": "assistant", "content": "three"},
                {"role": "user", "content": "two plus two ?"}, {"role": "assistant", "content": "four"}]
    ids, mask = gen.get_loss_mask(messages)
    assert ids == render_ids(tok, messages)  # the first message keeps the default system prompt, the others not
    assert marked(tok, ids, mask) == (
        "<|im_start|> system NL you are a helpful math tutor <|im_end|> NL <|im_start|> user NL one plus two ? "
        "<|im_end|> NL <|im_start|> assistant NL [three] [<|im_end|>] [NL] <|im_start|> user NL two plus two ? "
        "<|im_end|> NL <|im_start|> assistant NL [four] [<|im_end|>] [NL]")
    assert get_response_lengths([mask]) == [len(mask) - mask.index(1)]


def test_step_loss_mask_zero_leaves_a_turn_untrained(newline_tokenizers):
    tok = newline_tokenizers["default"]
    messages = [{"role": "user", "content": "one ?"}, {"role": "assistant", "content": "one", "step_loss_mask": 0},
                {"role": "user", "content": "two ?"}, {"role": "assistant", "content": "two"}]
    for kind in ("qwen", "qwen3", "qwen3_5"):
        ids, mask = MultiTurnLossMaskGenerator(tok, kind).get_loss_mask(messages)
        assert marked(tok, ids, mask) == (
            "<|im_start|> user NL one ? <|im_end|> NL <|im_start|> assistant NL one <|im_end|> NL <|im_start|> user NL "
            "two ? <|im_end|> NL <|im_start|> assistant NL [two] [<|im_end|>] [NL]"), kind


def test_qwen3_5_type_marks_characters_after_the_think_opening(newline_tokenizers):
    tok = newline_tokenizers["qwen3"]
    ids, mask = MultiTurnLossMaskGenerator(tok, "qwen3_5").get_loss_mask(SFT_CONVERSATION)
    assert ids == render_ids(tok, SFT_CONVERSATION)
    text = marked(tok, ids, mask)
    assert text.startswith(PROMPT + " <|im_start|> assistant NL <think> NL [add] [NL] [</think>]")
    assert text.endswith("</tool_response> <|im_end|> NL <|im_start|> assistant NL <think> NL [NL] [</think>] [NL] "
                         "[NL] [three] [<|im_end|>] [NL]")


def test_distill_qwen_type_trains_the_last_content_after_the_first_prompt(newline_tokenizers):
    tok = newline_tokenizers["default"]
    messages = [{"role": "user", "content": "one plus two ?"}, {"role": "assistant", "content": "it is three"}]
    ids, mask = MultiTurnLossMaskGenerator(tok, "distill_qwen").get_loss_mask(messages)
    assert marked(tok, ids, mask) == "<|im_start|> user NL one plus two ? <|im_end|> NL <|im_start|> assistant NL " \
                                     "[it] [is] [three]"  # no end-of-turn token: slime's rule
    tok_with_r1 = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok_with_r1.add_tokens(["\n"])
    tok_with_r1.add_special_tokens({"additional_special_tokens": ["<｜Assistant｜>"]})
    # the qwen type hands a DeepSeek-R1-distill tokenizer to distill_qwen, as slime does
    assert MultiTurnLossMaskGenerator(tok_with_r1, "qwen").get_loss_mask(messages) == (ids, mask)


def test_a_type_whose_template_assumption_fails_says_so(newline_tokenizers):
    # the qwen3 type renders each message next to a probe user message; the Qwen2.5-style default system
    # prompt breaks that (slime returns token ids and a mask of different lengths here)
    with pytest.raises(ChatTemplatePrefixError, match="loss mask type 'qwen3'"):
        MultiTurnLossMaskGenerator(newline_tokenizers["qwen25"], "qwen3").get_loss_mask(SFT_CONVERSATION[1:])
    with pytest.raises(ValueError, match=r"loss mask type 'llama3' \(--loss-mask-type\): choose one of qwen, qwen3"):
        MultiTurnLossMaskGenerator(newline_tokenizers["default"], "llama3")


def test_get_response_lengths_counts_from_the_first_trained_token():
    assert get_response_lengths([[0, 0, 1, 0, 1, 0], [0, 0], [1]]) == [4, 0, 1]
