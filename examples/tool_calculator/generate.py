"""Custom generate function of the calculator tool-use task (`--custom-generate-function-path`).

The episode, at most --max-turns model turns (2 in run-cpu.sh), each at most --rollout-max-response-len
tokens:

1. The model answers, or calls the calculator by writing the word `call`, optionally followed by an
   expression (`call 3 + 4`).
2. On a call the calculator evaluates the expression written after `call`; a bare `call` evaluates the
   question's own expression (the tool is bound to the task, like a search tool is bound to its corpus).
   Its result comes back as a `tool` message (chat template, loss mask 0) and the model takes its next turn.
3. The final answer is the first word of the model's last turn (`metadata["final_text"]`), scored by
   `reward.py`.

Simplifications, chosen so that a tiny random-init model with a word-level tokenizer can discover the tool
from reward on CPU: the call is one vocabulary word instead of a `<calc>...</calc>` tag (the tiny tokenizer
has no tag tokens), a bare call is allowed, and a turn that hits its token limit still counts as a call when
it holds `call` (a tiny model rarely emits the end-of-turn token).
"""

from __future__ import annotations

import re

from slime.rollout.multi_turn import (
    append_tool_tokens,
    context_left,
    generate_turn,
    render_tool_message,
    turn_budget_left,
)
from slime.rollout.sglang_rollout import get_tokenizer
from slime.utils.types import Sample

CALL = re.compile(r"\bcall\b(.*)", re.IGNORECASE | re.DOTALL)
EXPRESSION = re.compile(r"(\d+)\s*(?:\+|plus)\s*(\d+)", re.IGNORECASE)
DEFAULT_MAX_TURNS = 2


def question_of(prompt) -> str:
    """The user's text (the prompt is the rendered chat template, or a message list)."""
    if isinstance(prompt, list):
        return " ".join(str(m.get("content", "")) for m in prompt if m.get("role") == "user")
    return str(prompt)


def calculate(call_args: str, question: str) -> str:
    """The calculator: the sum written in the call, else the question's sum; "error" when there is none."""
    for text in (call_args, question):
        found = EXPRESSION.findall(text)
        if found:
            a, b = found[0]
            return str(int(a) + int(b))
    return "error"


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    tokenizer = get_tokenizer(args)
    template_kwargs = dict(getattr(args, "apply_chat_template_kwargs", None) or {})
    max_turns = DEFAULT_MAX_TURNS if getattr(args, "max_turns", None) is None else None
    question = question_of(sample.prompt)
    turns = tool_calls = 0
    text = ""
    while turn_budget_left(args, sample, turns, max_turns):
        text = await generate_turn(args, sample, sampling_params)
        turns += 1
        if sample.status == Sample.Status.ABORTED:
            break
        call = CALL.search(text)
        if call is None or not turn_budget_left(args, sample, turns, max_turns):
            break
        result = calculate(call.group(1), question)
        ids = render_tool_message(tokenizer, result, last_token=sample.tokens[-1], **template_kwargs)
        left = context_left(args, sample)
        if left is not None and len(ids) >= left:
            sample.status = Sample.Status.TRUNCATED
            break
        append_tool_tokens(sample, tokenizer, ids)
        tool_calls += 1
        sample.status = Sample.Status.COMPLETED  # a call cut by the turn's token limit still ran
    sample.metadata = dict(sample.metadata or {})
    sample.metadata.update(turns=turns, tool_calls=tool_calls, final_text=text)
    return sample
