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

Images: a sample whose prompt has images (`--multimodal-keys`) keeps them in every turn's request (its first turn
is sent as the single-turn rollout sends it, the prompt text with one placeholder per image; later turns as its ids,
the images' tokens expanded, with every image so far in `image_data`, which only the `hf` engine takes). A tool
result may itself carry images, as a list of content parts (`{"type": "text", "text": ...}`,
`{"type": "image", "image": <PIL image, data URI, base64 or path>}`): `render_observation` expands them with
--hf-checkpoint's processor and `append_observation` appends the tokens (loss mask 0) and adds the images to
`sample.multimodal_inputs["images"]` and their processed pixels to `sample.multimodal_train_inputs`, so the
trainer sees every image of the row in order.

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
from dataclasses import dataclass, field
from typing import Any

import torch

from slime.rollout.generation import (
    _aborted,
    append_model_tokens,
    get_processor,
    get_tokenizer,
    image_request,
    init_response,
    post_generate,
    processed_image_prompt,
    prompt_ids,
    sample_images,
)
from slime.utils.processing_utils import build_processor_kwargs, open_image
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
    if sample.tokens:
        used = len(sample.tokens)
    elif sample_images(sample):  # the prompt's image placeholders count as their images' tokens
        used = len(processed_image_prompt(args, sample)[0])
    else:
        used = len(prompt_ids(args, sample.prompt))
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

    `content`: one tool result, or a list for several consecutive tool messages (text only: a result with images
    goes through `render_observation`). Tokenising the text alone
    equals tokenising it in context because it starts at the template's special token after the content.
    """
    contents = tool_contents(content)
    if any(not isinstance(c, str) for c in contents):
        raise TypeError("render_tool_message renders text tool results; a result with content parts (images) "
                        "goes through render_observation(args, content, ...), which expands its images")
    text = _text_after_assistant(tokenizer, contents, role, tools, chat_template_kwargs)
    return _drop_repeated(list(tokenizer(text, add_special_tokens=False)["input_ids"]), last_token)


def tool_contents(content) -> list:
    """A tool result as a list of message contents: a string is one message, a list of content-part dicts is one
    message (a vision-language chat's), any other list holds one content (string or part list) per message."""
    one_part_list = isinstance(content, list) and content and all(isinstance(p, dict) for p in content)
    if isinstance(content, str) or one_part_list:
        return [content]
    return list(content)


def _text_after_assistant(renderer, contents: list, role: str, tools, chat_template_kwargs: dict) -> str:
    """The text that follows an assistant's content when `contents` come after it as `role` messages, up to the
    next assistant header (see render_tool_message). `renderer`: a tokenizer or a processor (its chat template)."""
    assistant = {"role": "assistant", "content": _ASSISTANT_MARK, "reasoning_content": "x"}
    messages = [_USER, assistant] + [{"role": role, "content": c} for c in contents]
    text = renderer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
    )
    at = text.rfind(_ASSISTANT_MARK)
    if at < 0:
        raise ValueError(
            f"render_tool_message: the chat template of {type(renderer).__name__}"
            f"({getattr(renderer, 'name_or_path', '?')}) does not render assistant content verbatim"
        )
    return text[at + len(_ASSISTANT_MARK) :]


def _drop_repeated(ids: list[int], last_token: int | None) -> list[int]:
    return ids[1:] if last_token is not None and ids and ids[0] == last_token else ids


# --- observations with images ----------------------------------------------------------------------------


@dataclass
class Observation:
    """Environment tokens to append after a model turn: `ids` (each image's tokens expanded), the `images` in the
    order of their runs in `ids`, and the processor's outputs for them (`pixel_values`, `image_grid_thw`; None
    without images)."""

    ids: list[int]
    images: list = field(default_factory=list)
    train_inputs: dict | None = None


def _is_image_part(part) -> bool:
    """Whether a content part is rendered as an image by a vision-language chat template."""
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url") or "image" in part
                                       or "image_url" in part)


def _part_image(part: dict):
    """The image of an image part: `image`, or OpenAI's `image_url` (`{"url": ...}` or the URL)."""
    image = part.get("image")
    if image is None:
        url = part.get("image_url")
        image = url.get("url") if isinstance(url, dict) else url
    if image is None:
        raise ValueError(f"a tool result's image part {sorted(part)} holds no image: give it as "
                         '{"type": "image", "image": <PIL image, data URI, base64 or path>}')
    return open_image(image).convert("RGB")


def render_observation(args, content, last_token: int | None = None, role: str = "tool",
                       tools: list[dict] | None = None, **chat_template_kwargs) -> Observation:
    """A tool result (see `tool_contents`; parts may hold images) rendered as `render_tool_message` does, with its
    images' placeholders expanded by --hf-checkpoint's processor: the same tokens the trainer will see for them.

    A text result gives `render_tool_message`'s ids. Images must come from a vision-language --hf-checkpoint (its
    processor and chat template render them); each is converted to RGB, as the engine receives it."""
    contents = tool_contents(content)
    images = [_part_image(p) for c in contents if not isinstance(c, str) for p in c if _is_image_part(p)]
    if not images:
        texts = [c if isinstance(c, str) else "".join(str(p.get("text", "")) for p in c) for c in contents]
        return Observation(render_tool_message(get_tokenizer(args), texts, last_token, role, tools,
                                               **chat_template_kwargs))
    processor = get_processor(args)
    if processor is None:
        raise ValueError(f"a tool result holds {len(images)} image(s) but --hf-checkpoint {args.hf_checkpoint} has no "
                         "multimodal processor to expand them; serve a vision-language model or return text")
    text = _text_after_assistant(processor, contents, role, tools, chat_template_kwargs)
    out = processor(text=text, **build_processor_kwargs({"images": images}))
    train_inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    return Observation(_drop_repeated(list(out["input_ids"][0]), last_token), images, train_inputs)


def merge_train_inputs(first: dict | None, second: dict | None) -> dict | None:
    """Processed images of one row: `second`'s tensors after `first`'s, key by key (images along dim 0)."""
    if not first or not second:
        return dict(first or second) if (first or second) else None
    if set(first) != set(second):
        raise ValueError(f"processed images with keys {sorted(first)} and {sorted(second)} cannot be joined in one "
                         "row: the prompt's and the observation's images must come from the same processor")
    return {k: torch.cat([first[k], second[k]], dim=0) for k in first}


def append_observation(sample: Sample, tokenizer, observation: Observation) -> list[int]:
    """Append an observation's tokens (loss mask 0, log-prob 0.0, as `append_tool_tokens`), its images after the
    sample's (`multimodal_inputs["images"]`, sent to the engine from the next turn on) and their processed pixels
    after the sample's (`multimodal_train_inputs`, for the trainer). The image lists are replaced, not changed in
    place: a group's samples may share the prompt's."""
    ids = append_tool_tokens(sample, tokenizer, observation.ids)
    if observation.images:
        sample.multimodal_inputs = {**(sample.multimodal_inputs or {}),
                                    "images": sample_images(sample) + list(observation.images)}
        sample.multimodal_train_inputs = merge_train_inputs(sample.multimodal_train_inputs, observation.train_inputs)
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

    images, prompt = image_request(args, sample)
    text, tokens, logprobs, status, weight_version = await post_generate(args, sample.tokens, params, images, prompt)
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
    `call_tool(call)` (sync or async) returns the tool's text, a list of content parts (text and images: one
    message), or a list of those (several tool messages). The tool result goes through `render_observation` (text:
    `render_tool_message`) with --apply-chat-template-kwargs, its images into the sample (`append_observation`).

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
        observation = render_observation(args, result, last_token=sample.tokens[-1], **template_kwargs)
        left = context_left(args, sample)
        if left is not None and len(observation.ids) >= left:  # no room for the result and one more model token
            sample.status = Sample.Status.TRUNCATED
            break
        append_observation(sample, tokenizer, observation)
        tool_calls += 1
    sample.metadata = dict(sample.metadata or {})
    sample.metadata["turns"] = turns
    sample.metadata["tool_calls"] = tool_calls
    return sample
