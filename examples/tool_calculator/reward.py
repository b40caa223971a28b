"""Reward of the calculator task (`--custom-rm-path examples/tool_calculator/reward.py`).

1.0 when the final answer equals the sum (the label); else 0.1 when the model called the calculator and
its final answer is a number (format credit: with GRPO's per-group normalisation this small difference is
what lets a random-init model find the tool, and answer with a number after it, before it can copy the
tool's result); else 0.0. The credit needs the number: crediting any call lets the policy collapse onto
writing `call` everywhere, where every sample of a group scores the same and learning stops. The final answer is the first word of the
model's last turn (`metadata["final_text"]`, set by generate.py), after an optional word `answer`; without
that metadata, the first word of the whole response.
"""

from __future__ import annotations

import re

WORD = re.compile(r"[a-z0-9]+")
FORMAT_SCORE = 0.1


def final_answer(text: str) -> str | None:
    words = WORD.findall(text.lower())
    if words and words[0] == "answer":
        words = words[1:]
    return words[0] if words else None


def score(final_text: str, label, tool_calls: int) -> float:
    answer = final_answer(final_text)
    if answer == str(label).strip().lower():
        return 1.0
    return FORMAT_SCORE if tool_calls > 0 and answer is not None and answer.isdigit() else 0.0


async def reward(args, sample) -> float:
    meta = sample.metadata or {}
    return score(meta.get("final_text", sample.response), sample.label, int(meta.get("tool_calls", 0)))
