"""`dapo`: DAPO-style math grading. Only the last 300 characters of the response are read; the prediction
is the text after the last "Answer:" there, both sides get a Minerva-style normalisation (last `=`
right-hand side, units and LaTeX decoration dropped, `\\boxed{}`/`\\text{}` unwrapped, `frac12` braced,
thousands separators removed) and are compared as strings. Returns `{"score": 1.0 | -1.0, "acc": bool,
"pred": str}`; train on it with `--reward-key score`.
"""

from __future__ import annotations

import re

from slime.rollout.rm_hub.math_utils import last_boxed_answer

_TAIL_CHARS = 300
_INVALID = "[INVALID]"

# fmt: off
_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_UNITS = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
          "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
          "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
          "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
          ",\\!", "{,}", '"', "\\dots"]
# fmt: on


def normalize_final_answer(answer: str) -> str:
    s = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        s = s.replace(old, new)
    for unit in _UNITS:
        s = s.replace(unit, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)
    for command in ("text", "textbf", "overline", "boxed"):
        s = re.sub(rf"(\\{command}\{{)(.*?)(\}})", r"\2", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_reward(response: str, label) -> dict:
    tail = response[-_TAIL_CHARS:]
    found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", tail)
    pred = normalize_final_answer(found[-1]) if found else _INVALID
    reference = str(label)
    boxed = last_boxed_answer(reference)
    reference = normalize_final_answer(boxed if boxed is not None else reference)
    correct = pred != _INVALID and pred == reference
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
