"""`f1`: SQuAD-style token F1 between the response and the label (the best over a list of labels).

Normalisation as in SQuAD evaluation: lower-case, drop punctuation and the articles a/an/the, split on
whitespace. Text before a closing `</think>` is ignored so reasoning does not dilute the answer.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_text(text: str) -> str:
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_text(prediction).split(), normalize_text(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1_reward(response: str, label) -> float:
    if "</think>" in response:
        response = response.split("</think>")[-1]
    labels = label if isinstance(label, (list, tuple)) else [label]
    return max((token_f1(response, str(ref)) for ref in labels if ref is not None), default=0.0)
