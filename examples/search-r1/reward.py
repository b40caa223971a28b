"""Search-R1 reward (`--custom-rm-path examples/search-r1/reward.py`): exact match with format credit.

- 1.0: the response is well formed and its last `<answer>...</answer>` equals the label after
  normalisation (lower case, punctuation and articles removed, whitespace collapsed; SQuAD style);
- FORMAT_SCORE (0.1): well formed, wrong answer;
- 0.0: not well formed (no answer tag, an unclosed search or answer tag).

Well formed: at least one complete `<answer>...</answer>`, tags balanced. Only model text counts: the
`<information>` blocks (environment text) are removed before checking.
"""

from __future__ import annotations

import re
import string

FORMAT_SCORE = 0.1
ANSWER = re.compile(r"<\s*answer\s*>(.*?)<\s*/\s*answer\s*>", re.DOTALL | re.IGNORECASE)
INFORMATION = re.compile(r"<\s*information\s*>.*?<\s*/\s*information\s*>", re.DOTALL | re.IGNORECASE)
OPEN = {tag: re.compile(rf"<\s*{tag}\s*>", re.IGNORECASE) for tag in ("search", "answer")}
CLOSE = {tag: re.compile(rf"<\s*/\s*{tag}\s*>", re.IGNORECASE) for tag in ("search", "answer")}


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def well_formed(response: str) -> bool:
    text = INFORMATION.sub(" ", response)
    if not ANSWER.search(text):
        return False
    return all(len(OPEN[t].findall(text)) == len(CLOSE[t].findall(text)) for t in OPEN)


def score(response: str, label) -> float:
    if not well_formed(response):
        return 0.0
    answer = ANSWER.findall(INFORMATION.sub(" ", response))[-1]
    labels = label if isinstance(label, list) else [label]
    return 1.0 if any(normalize(answer) == normalize(str(g)) for g in labels) else FORMAT_SCORE


async def reward(args, sample) -> float:
    return score(sample.response, sample.label)
