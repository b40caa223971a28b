"""DAPO's math grading at slime's path (`slime.rollout.rm_hub.math_dapo_utils`), the `dapo` reward type.

`compute_score(response, label)` reads only the last 300 characters of the response and returns
`{"score": 1.0 | -1.0, "acc": bool, "pred": str}` (train on it with `--reward-key score`):

- default (Minerva): the prediction is the text after the last `Answer:`, normalised by
  `normalize_final_answer` (the last `=` right-hand side, articles, `\\$`, units and LaTeX decoration
  dropped, `\\text{}`/`\\textbf{}`/`\\overline{}`/`\\boxed{}` unwrapped, `\\frac12` braced, thousands
  separators removed, end-of-text tokens such as `<|im_end|>` dropped); the label is normalised the same way
  and read as an integer, since every DAPO-Math answer is one;
- `strict_box_verify=True`: the content of the last `\\boxed{}` of the last 100 characters must equal the
  label exactly.

Deliberate difference from slime: a label that is not an integer raises a ValueError naming it (slime
truncates `3.7` to `3` and fails on `\\frac{1}{2}` with float()'s message); use `math` or `deepscaler` for such data.
"""

from __future__ import annotations

import re

from slime.rollout.rm_hub.math_utils import closing_brace_index

_BOXED_OPEN = "\\boxed{"
_INVALID = "[INVALID]"
_TAIL_CHARS = 300  # the longest MATH-500 answer has 159 characters
_STRICT_TAIL_CHARS = 100

# fmt: off
SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
    "<|im_end|>", "<|endoftext|>",
]
# fmt: on


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` of `string`, braces balanced (no `\\fbox` here); None when there is none."""
    start = string.rfind(_BOXED_OPEN)
    if start < 0:
        return None
    end = closing_brace_index(string, start)
    return None if end is None else string[start : end + 1]


def remove_boxed(s: str) -> str:
    """`\\boxed{x}` -> `x`; anything else raises AssertionError("box error: ...")."""
    if not (isinstance(s, str) and s.startswith(_BOXED_OPEN) and s.endswith("}")):
        raise AssertionError(f"box error: {s}")
    return s[len(_BOXED_OPEN) : -1]


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's normalisation of a final answer (see the module docstring)."""
    s = str(final_answer).split("=")[-1]
    for old, new in SUBSTITUTIONS:
        s = s.replace(old, new)
    for expression in REMOVED_EXPRESSIONS:
        s = s.replace(expression, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)  # keep only the first $...$ span
    for command in ("text", "textbf", "overline"):
        s = re.sub(rf"(\\{command}\{{)(.*?)(\}})", r"\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _integer_label(label: str) -> str:
    try:
        value = float(label)
    except ValueError:
        value = None
    if value is None or not value.is_integer():
        raise ValueError(
            f"dapo: label {label!r} is not an integer; the dapo grader (DAPO-Math) compares integer answers "
            "only: use --rm-type math or deepscaler for other answers"
        )
    return str(int(value))


def is_correct_minerva(
    solution_str: str, gt: str, gt_need_extract: bool = False, answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)"
) -> tuple[bool, str]:
    """(prediction == label, the normalised prediction): the prediction is the last `answer_pattern` match."""
    found = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(found[-1] if found else _INVALID)
    if gt_need_extract:
        gt = remove_boxed(last_boxed_only_string(gt))
    gt = _integer_label(normalize_final_answer(gt))
    return pred == gt, pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """(1 | -1, the boxed prediction): the last `\\boxed{}` of the last 100 characters (of those before the last
    of the 4 pause tokens, when given) must equal `gt` exactly."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 indices, got {pause_tokens_index!r}")
        pred = pred[pause_tokens_index[-1] - _STRICT_TAIL_CHARS :]
    else:
        pred = pred[-_STRICT_TAIL_CHARS:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(
    solution_str: str, answer: str, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> tuple[bool, str | None]:
    """(correct, prediction) by the strict-box or the Minerva rule."""
    if strict_box_verify:
        score, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return score == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict:
    """`{"score": 1.0 | -1.0, "acc": bool, "pred": ...}` for the last 300 characters of `solution_str`."""
    correct, pred = verify(solution_str[-_TAIL_CHARS:], ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
