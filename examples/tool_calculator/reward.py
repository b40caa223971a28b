"""Reward of the calculator task (`--custom-rm-path examples/tool_calculator/reward.py`).

1.0 when the final answer equals the sum (the label); else 0.1 when the model called the calculator and then
answered (any word but `call`); else 0.0. The final answer is the first word of the model's last turn
(`metadata["final_text"]`, set by generate.py), after an optional word `answer`; without that metadata, the
first word of the whole response.

Why this credit: a random-init model has to find the calculator before it can use it, and the 0.1 is what
makes calling spread (from ~3% of episodes to all of them in ~100 rollouts). It depends on the call, not on
the answer's form: an earlier credit for "called and answered with a digit" made the answer turn collapse onto
one digit (softmax policy gradients raise the likeliest of equally rewarded answers fastest) before the model
could learn to copy the result, and a credit for any call let the policy write `call` in every turn. Once every
episode calls and answers, the credit is the same for all samples of a group, GRPO's advantages ignore it and
only exact answers count.
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
    return FORMAT_SCORE if tool_calls > 0 and answer is not None and answer != "call" else 0.0


async def reward(args, sample) -> float:
    meta = sample.metadata or {}
    return score(meta.get("final_text", sample.response), sample.label, int(meta.get("tool_calls", 0)))
