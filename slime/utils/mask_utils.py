"""Loss masks for multi-turn chat data: 1 exactly on the tokens the model generates.

`build_loss_mask(tokenizer, messages)` returns `(token_ids, loss_mask)` where `token_ids` is the chat
template's rendering of the whole conversation and `loss_mask[k]` is 1 when token k belongs to an assistant
message's content or is the end-of-turn token the model must produce to end that message; role headers,
system/user/tool messages and template glue (e.g. Qwen's newline after `<|im_end|>`) are 0.

Method (incremental rendering, template-agnostic): for each assistant message i,
- `header_i` = render(messages[:i], add_generation_prompt=True) — what the model is prompted with;
- `turn_i`   = render(messages[:i+1]) — the same conversation ending with message i.
The model generated `turn_i[len(header_i):]` up to and including its first end-of-turn token (tokens
after it, like Qwen's trailing newline, are glue and stay 0). Templates that end an assistant message with
no token of its own (GLM-4: the next role token `<|user|>` / `<|observation|>` is what the model emits to
stop) get the first token after `turn_i` in the full rendering marked 1 when it is an end-of-turn token.

Assumption: each `header_i` is a prefix of `turn_i`, and each `turn_i` a prefix of the full rendering.
When a template breaks it (e.g. the Qwen3 template drops the reasoning of assistant messages before the
last user message, and with enable_thinking=False renders the empty think block only for the last
assistant message), `ChatTemplatePrefixError` names the tokenizer, the message index and the first
differing token instead of returning a wrong mask.

Simplifications: end-of-turn tokens are found by name (`DEFAULT_END_OF_TURN_TOKENS` plus the tokenizer's
eos); pass `end_of_turn_ids` for other templates. Cost is O(n^2) in the number of messages (each prefix
is rendered), fine for agent trajectories of tens of turns.
"""

from __future__ import annotations

import hashlib
from typing import Any

DEFAULT_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|user|>", "<|observation|>")


class ChatTemplatePrefixError(ValueError):
    """The chat template renders a prefix of the conversation differently from the full conversation."""


def tokenizer_name(tokenizer) -> str:
    """Class, path and a fingerprint of the chat template (tokenizers built in memory have no path)."""
    template = getattr(tokenizer, "chat_template", None)
    digest = hashlib.sha1(str(template).encode()).hexdigest()[:8] if template else "none"
    path = getattr(tokenizer, "name_or_path", "") or "<in memory>"
    return f"{type(tokenizer).__name__}({path!r}, chat_template sha1 {digest})"


def end_of_turn_ids(tokenizer) -> set[int]:
    """Ids of the known end-of-turn tokens this tokenizer has (and its eos)."""
    ids = set()
    unk = getattr(tokenizer, "unk_token_id", None)
    vocab = tokenizer.get_vocab()
    for name in DEFAULT_END_OF_TURN_TOKENS:
        if name in vocab and vocab[name] != unk:
            ids.add(vocab[name])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools=None, **kwargs) -> list[int]:
    """apply_chat_template(tokenize=True) as a plain list of ids (transformers 5 returns a dict by default)."""
    out = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False, **kwargs
    )
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _first_difference(a: list[int], b: list[int]) -> int:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return min(len(a), len(b))


def check_prefix(tokenizer, prefix: list[int], full: list[int], what: str, index: int) -> None:
    """Raise ChatTemplatePrefixError unless `prefix` is a prefix of `full`."""
    if full[: len(prefix)] == prefix:
        return
    k = _first_difference(prefix, full)
    got = tokenizer.convert_ids_to_tokens(prefix[k : k + 5])
    want = tokenizer.convert_ids_to_tokens(full[k : k + 5])
    raise ChatTemplatePrefixError(
        f"chat template of {tokenizer_name(tokenizer)}: {what} (message {index}) is not a prefix of the longer "
        f"rendering; first difference at token {k}: {got} vs {want}. Incremental loss masks need a template whose "
        "rendering of a conversation prefix is a prefix of the full rendering (Qwen3, for example, drops the "
        "reasoning of assistant messages before the last user message, and with enable_thinking=false renders "
        "the empty think block only on the last assistant message): keep one user query per trajectory, keep "
        "the reasoning, or use a template without this behaviour"
    )


def build_loss_mask(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    end_of_turn: set[int] | None = None,
    **chat_template_kwargs,
) -> tuple[list[int], list[int]]:
    """(token_ids, loss_mask) of `messages` rendered by the tokenizer's chat template; see the module doc.

    `chat_template_kwargs` go to every apply_chat_template call (e.g. enable_thinking=False).
    """
    if not messages:
        raise ValueError("build_loss_mask: no messages")
    eot = end_of_turn_ids(tokenizer) if end_of_turn is None else set(end_of_turn)
    full = render_ids(tokenizer, messages, tools=tools, **chat_template_kwargs)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        header = render_ids(tokenizer, messages[:i], add_generation_prompt=True, tools=tools, **chat_template_kwargs)
        turn = render_ids(tokenizer, messages[: i + 1], tools=tools, **chat_template_kwargs)
        check_prefix(tokenizer, header, turn, f"messages[:{i}] with the generation prompt", i)
        check_prefix(tokenizer, turn, full, f"messages[:{i + 1}]", i)
        ended = False
        for k in range(len(header), len(turn)):
            mask[k] = 1
            if full[k] in eot:
                ended = True
                break
        if not ended and len(turn) < len(full) and full[len(turn)] in eot:
            mask[len(turn)] = 1  # GLM-style: the next role token is the model's stop token
    return full, mask


class MultiTurnLossMaskGenerator:
    """slime-style wrapper: `get_loss_mask(messages, tools)` -> (token_ids, loss_mask).

    `tokenizer_type` is accepted for compatibility with slime's constructor and not used: the method above
    works for every template that satisfies the prefix assumption.
    """

    def __init__(self, tokenizer, tokenizer_type: str | None = None, **chat_template_kwargs):
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self.chat_template_kwargs = chat_template_kwargs

    def get_loss_mask(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        return build_loss_mask(self.tokenizer, messages, tools=tools, **self.chat_template_kwargs)

    def get_text_from_loss_mask(self, token_ids: list[int], loss_mask: list[int]) -> list[str]:
        """The decoded spans where the mask is 1 (for eyeballing a mask)."""
        spans, current = [], []
        for tok, m in zip(token_ids, loss_mask):
            if m:
                current.append(tok)
            elif current:
                spans.append(self.tokenizer.decode(current))
                current = []
        if current:
            spans.append(self.tokenizer.decode(current))
        return spans
