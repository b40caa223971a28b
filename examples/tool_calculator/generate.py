"""Custom generate function of the calculator tool-use task (`--custom-generate-function-path`).

The episode, at most --max-turns model turns (2 in run-cpu.sh), each at most --rollout-max-response-len
tokens:

1. The model answers, or calls the calculator by writing the word `call`, optionally followed by an
   expression (`call 3 + 4`).
2. On a call the calculator evaluates the expression written after `call`; a bare `call` adds the task's
   secret numbers (`metadata["numbers"]` of the data row: the environment's state, which the prompt does not
   show). Its result comes back as a `tool` message (chat template, loss mask 0) and the model takes its
   next turn.
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


def calculate(call_args: str, numbers: list[int] | None) -> str:
    """The calculator: the sum written in the call, else the sum of the task's secret numbers; "error" when
    there is neither."""
    found = EXPRESSION.findall(call_args)
    if found:
        a, b = found[0]
        return str(int(a) + int(b))
    if numbers:
        return str(sum(int(n) for n in numbers))
    return "error"


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    tokenizer = get_tokenizer(args)
    template_kwargs = dict(getattr(args, "apply_chat_template_kwargs", None) or {})
    max_turns = DEFAULT_MAX_TURNS if getattr(args, "max_turns", None) is None else None
    numbers = (sample.metadata or {}).get("numbers")
    if numbers is None:
        raise ValueError(f"calculator task: the sample (prompt {sample.prompt!r}) has no metadata['numbers']; its "
                         "data file predates examples/tool_calculator/make_data.py's secret numbers: delete it "
                         "(run-cpu.sh remakes it) or rerun make_data.py")
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
        result = calculate(call.group(1), numbers)
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
