"""The `f1` reward at slime's path (`slime.rollout.rm_hub.f1`): SQuAD-style token F1.

Both sides are normalised as in SQuAD's evaluation (lower case, punctuation dropped, the articles a/an/the
dropped, whitespace collapsed). A yes / no / noanswer answer on either side must match exactly: token
overlap earns nothing there. The whole response is compared (no reasoning is stripped first).
"""

from __future__ import annotations

import re
import string
from collections import Counter

ZERO_METRIC = (0, 0, 0)
_CLOSED_ANSWERS = ("yes", "no", "noanswer")
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    text = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_score(prediction: str | None, ground_truth: str) -> tuple[float, float, float]:
    """(f1, precision, recall) of the prediction's tokens against the label's; (0, 0, 0) without overlap."""
    if prediction is None:
        return ZERO_METRIC
    pred, truth = normalize_answer(prediction), normalize_answer(ground_truth)
    if (pred in _CLOSED_ANSWERS or truth in _CLOSED_ANSWERS) and pred != truth:
        return ZERO_METRIC
    pred_tokens, truth_tokens = pred.split(), truth.split()
    common = sum((Counter(pred_tokens) & Counter(truth_tokens)).values())
    if common == 0:
        return ZERO_METRIC
    precision, recall = common / len(pred_tokens), common / len(truth_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall
