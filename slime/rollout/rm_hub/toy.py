"""Reward for the CPU toy task (`tools/make_toy_data.py`): 1.0 when the first word of the response is the label."""

from __future__ import annotations

import re

_WORD = re.compile(r"[A-Za-z0-9]+")


def toy_reward(response: str, label: str) -> float:
    match = _WORD.search(response)
    return 1.0 if match is not None and match.group(0).lower() == str(label).strip().lower() else 0.0
