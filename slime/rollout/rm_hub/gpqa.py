"""The `gpqa` reward at slime's path (`slime.rollout.rm_hub.gpqa`): rule-based multiple-choice grading.

The correct letter comes from, in order: `metadata["correct_letter"]`; a one-letter label; an integer label
(an index into the valid letters, winning over `correct_letter`); a label equal to one of
`metadata["choices"]` (a list, or a dict whose values are the choices), compared case- and
punctuation-insensitively. The valid letters are `metadata["valid_letters"]`, else one per choice, else
`DEFAULT_VALID_LETTERS` (A-J).

The chosen letter is read from the text after the last `</think>`: the first "answer/option/choice (is|:) X",
else "X is (the) correct", else "final answer/option (is|:) X" (case-insensitive), each only when X is a
valid letter; else the last standalone capital that is a valid letter. Equal letters score 1.0, different
ones 0.0. Without both letters, a response that contains the correct choice's text, `metadata["correct_answer"]`,
`metadata["answer_text"]` or the label (normalised) scores 1.0. A None response scores 0.0.

Deliberate difference from slime: the letter after "answer is" must stand alone (slime's pattern reads the
"i" of "answer is (C)" as the letter I, and the "c" of "answer is clearly B" as C).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

DEFAULT_VALID_LETTERS = list(string.ascii_uppercase[:10])

_NAMED_PATTERNS = (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*\b([A-Z])\b",
    r"\b([A-Z])\b\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*\b([A-Z])\b",
)
_STANDALONE_CAPITAL = re.compile(r"\b([A-Z])\b")


def _strip_chain_of_thought(text: str | None) -> str:
    if not text:
        return ""
    return text.rsplit("</think>", 1)[-1]


def _normalize_text(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _extract_letter_from_response(response: str | None, valid_letters: Iterable[str]) -> str | None:
    """The option letter the response chose (see the module docstring), or None."""
    if not response:
        return None
    text = _strip_chain_of_thought(response)
    valid = {letter.upper() for letter in valid_letters}
    for pattern in _NAMED_PATTERNS:
        match = re.search(pattern, text, flags=re.IGNORECASE)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    for letter in reversed(_STANDALONE_CAPITAL.findall(text)):
        if letter in valid:
            return letter
    return None


def _choices_of(metadata: dict) -> list | None:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return list(choices.values())
    return None if choices is None else list(choices)


def _valid_letters_of(metadata: dict, choices: list | None) -> list[str]:
    if metadata.get("valid_letters"):
        return [str(letter).upper() for letter in metadata["valid_letters"]]
    if choices:
        return list(string.ascii_uppercase[: len(choices)])
    return DEFAULT_VALID_LETTERS


def _correct_letter_of(label, metadata: dict, choices: list | None, valid_letters: list[str]) -> str | None:
    given = metadata.get("correct_letter")
    correct = given.strip().upper() if isinstance(given, str) else None
    if isinstance(label, str):
        text = label.strip()
        if not correct and len(text) == 1 and text.upper() in valid_letters:
            correct = text.upper()
    elif isinstance(label, (int, float)) and 0 <= int(label) < len(valid_letters):
        correct = valid_letters[int(label)]
    if not correct and choices and isinstance(label, str) and label.strip():
        target = _normalize_text(label.strip())
        for index, choice in enumerate(choices[: len(valid_letters)]):
            if _normalize_text(str(choice)) == target:
                return valid_letters[index]
    return correct or None


def _answer_texts(label, metadata: dict, choices: list | None, valid_letters: list[str], correct: str | None):
    """The texts whose presence in the response counts as the right answer."""
    texts = []
    if correct and choices and correct in valid_letters:
        index = valid_letters.index(correct)
        if index < len(choices):
            texts.append(str(choices[index]))
    for key in ("correct_answer", "answer_text"):
        if metadata.get(key):
            texts.append(str(metadata[key]))
    if isinstance(label, str) and label.strip():
        texts.append(label.strip())
    return texts


def compute_gpqa_reward(response: str | None, label, metadata: dict | None = None) -> float:
    """1.0 when the response chose (or states) the correct option, else 0.0 (see the module docstring)."""
    if response is None:
        return 0.0
    metadata = metadata or {}
    choices = _choices_of(metadata)
    valid_letters = _valid_letters_of(metadata, choices)
    correct = _correct_letter_of(label, metadata, choices, valid_letters)
    chosen = _extract_letter_from_response(response, valid_letters)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0
    said = _normalize_text(_strip_chain_of_thought(response))
    for text in _answer_texts(label, metadata, choices, valid_letters, correct):
        target = _normalize_text(text)
        if target and target in said:
            return 1.0
    label_text = label.strip() if isinstance(label, str) else ""
    if chosen and not correct and label_text:
        return 1.0 if chosen == label_text.upper() else 0.0
    return 0.0
