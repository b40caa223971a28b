"""Reward for the CPU toy task (`tools/make_toy_data.py`).

1.0 when the first word of the response is the label; 0.1 when it is a number but the wrong one (a small
format reward, as math graders give, so that a random-init policy first learns to answer with a number);
0.0 otherwise.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"[A-Za-z0-9]+")
FORMAT_REWARD = 0.1


def toy_reward(response: str, label: str) -> float:
    match = _WORD.search(response)
    if match is None:
        return 0.0
    word = match.group(0).lower()
    if word == str(label).strip().lower():
        return 1.0
    return FORMAT_REWARD if word.isdigit() else 0.0
