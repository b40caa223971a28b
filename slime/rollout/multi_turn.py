"""Helpers for multi-turn custom generate functions (`--custom-generate-function-path`).

A custom generate function `async def generate(args, sample, sampling_params, evaluation=False)` that
runs an agent loops: one model turn (`generate_turn`), parse a tool call, run the tool, append the tool
result (`render_tool_message` + `append_tool_tokens`), and again while `turn_budget_left`. `tool_loop` is
that loop, ready to use with a `parse_call` and a `call_tool` of your own.

Everything is token-in, token-out: the model's tokens are appended exactly as the engine returned them
(never re-tokenised from text), with loss mask 1 and their log-probs; environment tokens get loss mask 0
and log-prob 0.0, so `loss_mask` and `rollout_log_probs` stay one entry per response token. The helpers
change the sample's `tokens`, `loss_mask` and `rollout_log_probs` lists in place, so a plugin holding one of
them sees every append.

Budgets: `sampling_params["max_new_tokens"]` (--rollout-max-response-len) bounds each turn;
`--rollout-max-context-len` bounds prompt + all turns + tool results (a turn gets at most what is left, and
a tool result that does not fit ends the trajectory as TRUNCATED rather than overflowing); `--max-turns`
(or `tool_loop(max_turns=...)`) bounds the number of model turns.

Reused from the default rollout's generation (`slime.rollout.generation`): `prompt_ids`, `get_tokenizer`,
`post_generate` (the /generate request with its retries and answer parsing) and `_aborted` (private: the
per-rollout abort flag), so a multi-turn sample is tokenised, requested and aborted exactly like a
single-turn one.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from slime.rollout.generation import (
    _aborted,
    append_model_tokens,
    get_tokenizer,
    init_response,
    post_generate,
    prompt_ids,
)
from slime.utils.types import Sample

# The dummy conversation `render_tool_message` renders the tool message after. The assistant message
# carries reasoning so that thinking-aware templates (Qwen3) render it the same whether it is last or not.
_USER = {"role": "user", "content": "x"}
_ASSISTANT_MARK = "SLIMEASSISTANTTURNEND"


# --- budgets ---------------------------------------------------------------------------------------------


def context_left(args, sample: Sample) -> int | None:
    """Tokens left under --rollout-max-context-len (None: no limit)."""
    limit = args.rollout_max_context_len
    if not limit:
        return None
    used = len(sample.tokens) if sample.tokens else len(prompt_ids(args, sample.prompt))
    return int(limit) - used


def turn_budget_left(args, sample: Sample, turn: int, max_turns: int | None = None) -> bool:
    """Whether model turn number `turn` (0-based: the number of turns already taken) may run.

    False once `turn` reaches `max_turns` (default: --max-turns; None: no turn limit) or no token is left
    under --rollout-max-context-len.
    """
    limit = max_turns if max_turns is not None else args.max_turns
    if limit is not None and turn >= int(limit):
        return False
    left = context_left(args, sample)
    return left is None or left > 0


# --- appending tokens ------------------------------------------------------------------------------------


def append_tool_tokens(sample: Sample, tokenizer, text_or_ids: str | list[int]) -> list[int]:
    """Append environment tokens (a tool result, the next assistant header): loss mask 0, log-prob 0.0.

    A string is tokenised without special tokens added (special tokens written in it, like `<|im_start|>`,
    are still recognised); a list is taken as token ids. `sample.response` gets the decoded text. Returns
    the ids appended. The appending is `Sample.append_response_tokens` with `trainable=False`.
    """
    if isinstance(text_or_ids, str):
        ids = list(tokenizer(text_or_ids, add_special_tokens=False)["input_ids"])
        text = text_or_ids
    else:
        ids = [int(t) for t in text_or_ids]
        text = tokenizer.decode(ids)
    sample.append_response_tokens(tokens=ids, trainable=False, text=text)
    return ids


def render_tool_message(
    tokenizer,
    content: str | list[str],
    last_token: int | None = None,
    role: str = "tool",
    tools: list[dict] | None = None,
    **chat_template_kwargs,
) -> list[int]:
    """Token ids that follow an assistant turn: the tool message(s) as the chat template renders them after
    an assistant message, then the next assistant header (the generation prompt).

    Method: render `[user, assistant(MARK), tool...]` with add_generation_prompt=True and take the text after
    MARK, the assistant's content: this is the difference between rendering [..., assistant, tool] with the
    generation prompt and [..., assistant] up to its content, so it also holds the template's end of the
    assistant message (Qwen: `<|im_end|>\\n`; Llama-3: `<|eot_id|>`; GLM-4: nothing, the `<|observation|>`
    role token comes next). Anchoring at the content instead of diffing against the rendering of
    [..., assistant] matters for templates that render the last assistant message differently (Qwen3 adds an
    empty think block to it). The leading token is dropped when it equals `last_token` (pass
    `sample.tokens[-1]`): the model already generated its end-of-turn / stop token.

    `content`: one tool result, or a list for several consecutive tool messages. Tokenising the text alone
    equals tokenising it in context because it starts at the template's special token after the content.
    """
    contents = [content] if isinstance(content, str) else list(content)
    assistant = {"role": "assistant", "content": _ASSISTANT_MARK, "reasoning_content": "x"}
    messages = [_USER, assistant] + [{"role": role, "content": c} for c in contents]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
    )
    at = text.rfind(_ASSISTANT_MARK)
    if at < 0:
        raise ValueError(
            f"render_tool_message: the chat template of {type(tokenizer).__name__}"
            f"({getattr(tokenizer, 'name_or_path', '?')}) does not render assistant content verbatim"
        )
    ids = list(tokenizer(text[at + len(_ASSISTANT_MARK) :], add_special_tokens=False)["input_ids"])
    if last_token is not None and ids and ids[0] == last_token:
        ids = ids[1:]
    return ids


# --- one model turn --------------------------------------------------------------------------------------


async def generate_turn(args, sample: Sample, sampling_params: dict, stop: str | list[str] | None = None) -> str:
    """One model turn continuing from `sample.tokens` (the prompt's ids when empty); returns its text.

    Appends the generated tokens with loss mask 1 and their log-probs, records the weight version, and sets
    `sample.status` from the finish reason (stop: COMPLETED, length: TRUNCATED, abort: ABORTED). The turn
    gets `max_new_tokens` from `sampling_params`, lowered to what --rollout-max-context-len leaves; with
    nothing left it generates nothing and marks the sample TRUNCATED. `stop` strings are added to
    `sampling_params["stop"]` (with no_stop_trim the stop string stays in the tokens and text).
    """
    if _aborted():
        sample.status = Sample.Status.ABORTED
        return ""
    resuming = sample.status == Sample.Status.ABORTED and sample.response_length > 0
    init_response(args, sample)
    if resuming and args.mask_offpolicy_in_partial_rollout:
        sample.loss_mask[:] = [0] * sample.response_length  # older weights' tokens: context, not targets

    params = dict(sampling_params)
    if stop:
        extra = [stop] if isinstance(stop, str) else list(stop)
        old = params.get("stop") or []
        params["stop"] = ([old] if isinstance(old, str) else list(old)) + extra
    max_new = int(params["max_new_tokens"])
    left = context_left(args, sample)
    if left is not None:
        max_new = min(max_new, left)
    if max_new <= 0:
        sample.status = Sample.Status.TRUNCATED
        return ""
    params["max_new_tokens"] = max_new

    text, tokens, logprobs, status, weight_version = await post_generate(args, sample.tokens, params)
    append_model_tokens(sample, tokens, logprobs, text, weight_version)
    sample.status = status
    return text


# --- a reference loop ------------------------------------------------------------------------------------


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_call_tag(text: str) -> dict | str | None:
    """The last `<tool_call>...</tool_call>` of `text` (Qwen / Hermes style): its JSON when it parses, else the
    stripped inner text; None without a tool call."""
    found = _TOOL_CALL.findall(text)
    if not found:
        return None
    inner = found[-1].strip()
    try:
        return json.loads(inner)
    except ValueError:
        return inner


async def tool_loop(
    args,
    sample: Sample,
    sampling_params: dict,
    call_tool: Callable[[Any], str | list[str] | Awaitable[str | list[str]]],
    parse_call: Callable[[str], Any] = parse_tool_call_tag,
    max_turns: int | None = None,
    stop: str | list[str] | None = None,
) -> Sample:
    """generate -> parse a call -> run the tool -> append its result -> generate again, until the model
    answers without a call, a turn does not finish with a stop (length / abort), or a budget runs out.

    `parse_call(text)` returns None when the turn holds no tool call, else whatever `call_tool` takes;
    `call_tool(call)` (sync or async) returns the tool's text (or a list: several tool messages). The tool
    result goes through `render_tool_message` with --apply-chat-template-kwargs.

    Final status: that of the last turn (COMPLETED, TRUNCATED, ABORTED), except TRUNCATED when the model
    still asked for a tool after its last allowed turn or the tool result did not fit the context budget (the
    tool is then not called / its result not appended). `metadata["turns"]` counts model turns and
    `metadata["tool_calls"]` the tool results appended.
    """
    tokenizer = get_tokenizer(args)
    template_kwargs = dict(args.apply_chat_template_kwargs or {})
    turns = tool_calls = 0
    while turn_budget_left(args, sample, turns, max_turns):
        text = await generate_turn(args, sample, sampling_params, stop=stop)
        turns += 1
        if sample.status != Sample.Status.COMPLETED:
            break
        call = parse_call(text)
        if call is None:
            break
        if not turn_budget_left(args, sample, turns, max_turns):
            sample.status = Sample.Status.TRUNCATED
            break
        result = call_tool(call)
        if inspect.isawaitable(result):
            result = await result
        ids = render_tool_message(tokenizer, result, last_token=sample.tokens[-1], **template_kwargs)
        left = context_left(args, sample)
        if left is not None and len(ids) >= left:  # no room for the result and one more model token
            sample.status = Sample.Status.TRUNCATED
            break
        append_tool_tokens(sample, tokenizer, ids)
        tool_calls += 1
    sample.metadata = dict(sample.metadata or {})
    sample.metadata["turns"] = turns
    sample.metadata["tool_calls"] = tool_calls
    return sample
