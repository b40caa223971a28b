"""`gpqa`: multiple choice. The label is the correct option letter ("C"), its 0-based index, or the
correct choice's text; `metadata["choices"]` (a list of option texts), when present, maps between them.

The predicted letter is taken, in order of preference, from `\\boxed{X}`, "answer is X" / "Answer: X",
or the last standalone option letter of the text after `</think>`. A response that instead states the
correct choice's text (normalised, exact) also scores 1. Simplification: no partial credit, no fuzzy text match.
"""

from __future__ import annotations

import re
import string

from slime.rollout.rm_hub.f1 import normalize_text
from slime.rollout.rm_hub.math_utils import last_boxed_answer


def _letters(choices) -> str:
    return string.ascii_uppercase[: len(choices)] if choices else "ABCD"


def _correct_letter(label, choices) -> str | None:
    letters = _letters(choices)
    if isinstance(label, int) and 0 <= label < len(letters):
        return letters[label]
    text = str(label).strip()
    if len(text) == 1 and text.upper() in letters:
        return text.upper()
    stripped = text.strip("()").strip()
    if len(stripped) == 1 and stripped.upper() in letters:
        return stripped.upper()
    if choices:
        for letter, choice in zip(letters, choices):
            if normalize_text(choice) == normalize_text(text):
                return letter
    return None


def predicted_letter(response: str, letters: str = "ABCD") -> str | None:
    text = response.split("</think>")[-1]
    boxed = last_boxed_answer(text)
    if boxed is not None:
        m = re.fullmatch(rf"\s*\(?([{letters}])\)?\s*", boxed.replace("\\text{", "").replace("}", ""))
        if m:
            return m.group(1)
    said = re.findall(rf"(?i:answer)\s*(?:is|:)?\s*:?\s*\(?([{letters}])\)?(?![A-Za-z])", text)
    if said:
        return said[-1]
    standalone = re.findall(rf"(?<![A-Za-z])\(?([{letters}])\)?(?![A-Za-z])", text)
    return standalone[-1] if standalone else None


def gpqa_reward(response: str, label, metadata: dict | None = None) -> float:
    choices = (metadata or {}).get("choices") or (metadata or {}).get("options")
    correct = _correct_letter(label, choices)
    if correct is not None and predicted_letter(response, _letters(choices)) == correct:
        return 1.0
    if choices and correct is not None:
        tail = normalize_text(response.split("</think>")[-1])
        target = normalize_text(choices[_letters(choices).index(correct)])
        if target and tail.endswith(target):
            return 1.0
    return 0.0
