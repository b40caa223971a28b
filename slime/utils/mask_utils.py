"""Loss masks for chat data: which tokens of a rendered conversation are trained on.

Two ways, one module:

- `MultiTurnLossMaskGenerator(tokenizer, tokenizer_type)` with slime's loss-mask types (`--loss-mask-type`, read by
  `slime.rollout.sft_rollout`), each following slime's rule for the template family it is named after:
  - `qwen`: every message rendered on its own (the first with the tools); the default system prompt the template
    puts before a lone message is cut from all but the first; an assistant message is trained on after its
    generation prompt (`<|im_start|>assistant\n`): its content, `<|im_end|>` and the newline after it. A tokenizer
    with DeepSeek-R1-distill's `<｜Assistant｜>` token is handled as `distill_qwen`;
  - `qwen3`: the same, each message rendered next to a probe user message (after it; the first one before it) so
    that the Qwen3 template renders it as it would inside a conversation (an assistant message keeps its think
    block); consecutive tool messages are rendered together (the template wraps them in one user turn);
  - `qwen3_5`: the whole conversation rendered once; characters from each assistant message's content (after a
    leading `<think>\n`) up to and including its `<|im_end|>` and newline are marked, and a token is trained on
    when any of its characters is (needs a fast tokenizer's offsets);
  - `distill_qwen`: the first message rendered with the generation prompt, then the last message's content
    tokenized as it is (no end-of-turn token), the only part trained on.
  A message with `step_loss_mask` other than 1 is not trained on (every type). `get_response_lengths` (slime's)
  is the length from a mask's first 1 to its end: the response slime's SFT rollout trains.
- `build_loss_mask(tokenizer, messages)` (`tokenizer_type=None` in the generator): template-agnostic, by
  incremental rendering, for templates no slime type covers (GLM-4, Llama-3, ...). It returns `(token_ids,
  loss_mask)` where `token_ids` is the chat template's rendering of the whole conversation and `loss_mask[k]` is
  1 when token k belongs to an assistant message's content or is the end-of-turn token the model must produce to
  end that message; role headers, system/user/tool messages and template glue (e.g. Qwen's newline after
  `<|im_end|>`) are 0.

Method of `build_loss_mask`: for each assistant message i,
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
differing token instead of returning a wrong mask. The slime types make assumptions of their own (a lone
message renders as its block inside a conversation; the probe renders the same before and after a message); where
one does not hold, `ChatTemplatePrefixError` says so, where slime would return a mask of the wrong tokens.

Simplifications: end-of-turn tokens are found by name (`DEFAULT_END_OF_TURN_TOKENS` plus the tokenizer's
eos); pass `end_of_turn_ids` for other templates. Cost is O(n^2) in the number of messages (each prefix
is rendered), fine for agent trajectories of tens of turns. slime's multimodal alignment of a mask
(`get_loss_mask_with_multimodal_alignment`) is not here: the trainers take text only.
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


LOSS_MASK_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")  # slime's --loss-mask-type choices
_PROBE = "FOR CALCULATING LOSS MASK ONLY"
_DISTILL_ASSISTANT_TOKEN = "<｜Assistant｜>"  # DeepSeek-R1-distill tokenizers: `qwen` masks them as distill_qwen
_QWEN_ASSISTANT_HEADER, _QWEN_THINK, _QWEN_END = "<|im_start|>assistant\n", "<think>\n", "<|im_end|>"


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """slime's response length of each mask: from its first 1 to its end (0 when it has none)."""
    return [len(mask) - mask.index(1) if 1 in mask else 0 for mask in loss_masks]


def _trained(message: dict) -> bool:
    return message.get("step_loss_mask", 1) == 1


class MultiTurnLossMaskGenerator:
    """slime's `MultiTurnLossMaskGenerator(tokenizer, tokenizer_type="qwen")`: `get_loss_mask(messages, tools)`
    -> (token_ids, loss_mask) by one of slime's loss-mask types (the module docstring), or by `build_loss_mask` with
    `tokenizer_type=None`. `chat_template_kwargs` go to every apply_chat_template call (slime passes none)."""

    def __init__(self, tokenizer, tokenizer_type: str | None = "qwen", **chat_template_kwargs):
        if tokenizer_type is not None and tokenizer_type not in LOSS_MASK_TYPES:
            raise ValueError(f"loss mask type {tokenizer_type!r} (--loss-mask-type): choose one of "
                             f"{', '.join(LOSS_MASK_TYPES)} (slime's), or None for the template-agnostic "
                             "build_loss_mask")
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self.chat_template_kwargs = chat_template_kwargs
        self.system_message_length = self.gen_token_length = 0
        self._system_prefix: list[int] = []  # what is cut from a lone message after the first
        self._generation_prompt: list[int] = []  # the untrained start of an assistant message
        if tokenizer_type in ("qwen", "qwen3"):
            self.system_message_length, self.gen_token_length = self.get_system_message_length()
            probe = {"role": "user", "content": _PROBE}
            self._system_prefix = self._render([probe])[: self.system_message_length]
            prompted = self._render([probe, probe], add_generation_prompt=True)
            self._generation_prompt = prompted[len(prompted) - self.gen_token_length:]

    def _render(self, messages: list[dict], tools=None, add_generation_prompt: bool = False) -> list[int]:
        return render_ids(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                          **self.chat_template_kwargs)

    def get_system_message_length(self) -> tuple[int, int]:
        """(tokens the template puts before a lone non-system message, e.g. Qwen2.5's default system prompt;
        tokens of its generation prompt), measured on one and two probe user messages: one renders as
        prefix + block, two as prefix + 2 blocks."""
        probe = {"role": "user", "content": _PROBE}
        one, two = self._render([probe]), self._render([probe, probe])
        prefix = 2 * len(one) - len(two)
        if prefix < 0 or two[:prefix] != one[:prefix]:
            raise ChatTemplatePrefixError(
                f"chat template of {tokenizer_name(self.tokenizer)}: loss mask type {self.tokenizer_type!r} needs a "
                "template that renders each message as a block of its own after a fixed prefix (Qwen's); this one "
                "does not: use --loss-mask-type for its family or the template-agnostic build_loss_mask")
        gen = len(self._render([probe, probe], add_generation_prompt=True)) - len(two)
        return prefix, gen

    # ---- slime's types ----------------------------------------------------------------------------------
    def get_loss_mask(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        if not messages:
            raise ValueError("get_loss_mask: no messages")
        kind = self.tokenizer_type
        if kind is None:
            return build_loss_mask(self.tokenizer, messages, tools=tools, **self.chat_template_kwargs)
        if kind == "qwen" and _DISTILL_ASSISTANT_TOKEN in self.tokenizer.get_added_vocab():
            kind = "distill_qwen"
        return getattr(self, f"gen_multi_turn_loss_mask_{kind}")(messages, tools)

    def _message_mask(self, message: dict, ids: list[int], index: int) -> list[int]:
        """An assistant message after its generation prompt, nothing of the others (nor of a step_loss_mask 0)."""
        if message["role"] != "assistant" or not _trained(message):
            return [0] * len(ids)
        check_prefix(self.tokenizer, self._generation_prompt, ids,
                     f"the generation prompt before assistant message {index}", index)
        return [0] * self.gen_token_length + [1] * (len(ids) - self.gen_token_length)

    def _cut_system_prefix(self, message: dict, ids: list[int], index: int) -> list[int]:
        """A lone message after the first: without the prefix the template puts before it."""
        if index == 0 or message["role"] == "system" or not self.system_message_length:
            return ids
        check_prefix(self.tokenizer, self._system_prefix, ids,
                     f"the system prompt before message {index} rendered alone", index)
        return ids[self.system_message_length:]

    def gen_multi_turn_loss_mask_qwen(self, messages: list[dict], tools: list[dict] | None = None
                                      ) -> tuple[list[int], list[int]]:
        token_ids, loss_mask = [], []
        for i, message in enumerate(messages):
            ids = self._cut_system_prefix(message, self._render([message], tools=tools if i == 0 else None), i)
            token_ids += ids
            loss_mask += self._message_mask(message, ids, i)
        return token_ids, loss_mask

    def gen_multi_turn_loss_mask_qwen3(self, messages: list[dict], tools: list[dict] | None = None
                                       ) -> tuple[list[int], list[int]]:
        probe = {"role": "user", "content": _PROBE}
        probe_ids = self._render([probe])
        token_ids, loss_mask = [], []
        i = 0
        while i < len(messages):
            end = i + 1
            if messages[i]["role"] == "tool":  # Qwen templates wrap consecutive tool results in one user turn
                while end < len(messages) and messages[end]["role"] == "tool":
                    end += 1
            group = messages[i:end]
            if i == 0:
                ids = self._render(group + [probe], tools=tools)
                if ids[len(ids) - len(probe_ids):] != probe_ids:
                    raise ChatTemplatePrefixError(
                        f"chat template of {tokenizer_name(self.tokenizer)}: loss mask type 'qwen3': message 0 "
                        "followed by a user message does not end with that message's own rendering; the template "
                        "is not Qwen3's: use --loss-mask-type for its family")
                ids = ids[: len(ids) - len(probe_ids)]
            else:
                ids = self._render([probe] + group)
                check_prefix(self.tokenizer, probe_ids, ids, "a user message rendered before it", i)
                ids = ids[len(probe_ids):]
            ids = self._cut_system_prefix(messages[i], ids, i)
            token_ids += ids
            loss_mask += self._message_mask(messages[i], ids, i)
            i = end
        return token_ids, loss_mask

    def gen_multi_turn_loss_mask_qwen3_5(self, messages: list[dict], tools: list[dict] | None = None
                                         ) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, tools=tools, **self.chat_template_kwargs)
        if not getattr(tok, "is_fast", False):
            raise ValueError(f"loss mask type 'qwen3_5' needs a fast tokenizer (character offsets of its tokens); "
                             f"{tokenizer_name(tok)} is not one")
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        token_ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
        if token_ids != self._render(messages, tools=tools):
            raise ChatTemplatePrefixError(
                f"chat template of {tokenizer_name(tok)}: loss mask type 'qwen3_5' tokenizes the rendered text, "
                "which here gives other tokens than apply_chat_template(tokenize=True); use another loss mask type")
        marked = [0] * (len(text) + 1)  # prefix sums of the characters to train on
        chars = [0] * len(text)
        cursor = 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            header = text.find(_QWEN_ASSISTANT_HEADER, cursor)
            end = text.find(_QWEN_END, header + len(_QWEN_ASSISTANT_HEADER)) if header >= 0 else -1
            if end < 0:
                raise ChatTemplatePrefixError(
                    f"chat template of {tokenizer_name(tok)}: loss mask type 'qwen3_5': assistant message {k} is not "
                    f"rendered as {_QWEN_ASSISTANT_HEADER!r} ... {_QWEN_END!r}; use another loss mask type")
            start = header + len(_QWEN_ASSISTANT_HEADER)
            stop = end + len(_QWEN_END)
            stop += text[stop:stop + 1] == "\n"
            cursor = stop
            if not _trained(message):
                continue
            if text.startswith(_QWEN_THINK, start):
                start += len(_QWEN_THINK)
            chars[start:stop] = [1] * (stop - start)
        for c, value in enumerate(chars):
            marked[c + 1] = marked[c] + value
        loss_mask = [int(b > a and marked[b] > marked[a]) for a, b in offsets]
        return token_ids, loss_mask

    def gen_multi_turn_loss_mask_distill_qwen(self, messages: list[dict], tools: list[dict] | None = None
                                              ) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, tools=tools,
                                         **self.chat_template_kwargs)
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tok(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        trained = int(_trained(messages[-1]))
        return list(prompt_ids) + list(response_ids), [0] * len(prompt_ids) + [trained] * len(response_ids)

    # ---- slime's helpers ----------------------------------------------------------------------------------
    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

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
