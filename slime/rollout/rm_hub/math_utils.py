"""Answer extraction and comparison for math rewards (`math`, `deepscaler`, the `boxed_` prefix).

Simplifications: answers are compared after a string normalisation (LaTeX spacing, `\\left`/`\\right`,
`\\text{}`, `dfrac`/`tfrac`, degrees, dollars, trailing period, a lone `x =`); then as plain numbers
(`1,000` = `1000` = `1000.0`); then, for short expressions made only of digits, single-letter variables,
`+ - * / ^ ( ) .` and `\\frac`/`\\sqrt`/`^{}`, by asking sympy whether their difference simplifies to 0. No LaTeX
parser is involved, so e.g. matrices or sets are compared as strings only.
"""

from __future__ import annotations

import re

_BOXED_PREFIXES = ("\\boxed", "\\fbox")


def last_boxed_answer(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed x`) in `text`, braces balanced."""
    if not text:
        return None
    start = max(text.rfind(p) for p in _BOXED_PREFIXES)
    if start < 0:
        return None
    prefix = next(p for p in _BOXED_PREFIXES if text.startswith(p, start))
    i = start + len(prefix)
    if i < len(text) and text[i] == " ":
        # "\boxed 5": the answer runs to the next "$" or whitespace
        rest = text[i + 1 :]
        return re.split(r"[$\s]", rest, maxsplit=1)[0] or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _strip_wrapper(s: str, command: str) -> str:
    """`\\text{abc}` -> `abc` for every occurrence of `command` with balanced braces."""
    out, i = [], 0
    token = command + "{"
    while True:
        k = s.find(token, i)
        if k < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:k])
        depth, j = 0, k + len(command)
        while j < len(s):
            if s[j] == "{":
                depth += 1
            elif s[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        out.append(s[k + len(token) : j])
        i = j + 1


def normalize_answer(answer: str | None) -> str:
    """A canonical string form of a final answer, for equality checks."""
    if answer is None:
        return ""
    s = str(answer).strip()
    inner = last_boxed_answer(s)
    if inner is not None:
        s = inner
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    for command in ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\mbox"):
        s = _strip_wrapper(s, command)
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\%", "").replace("%", "").replace("$", "")
    s = s.replace(" ", "")
    s = s.rstrip(".")
    # "x=5" -> "5" (a single short left-hand side only, so "a=b=c" style answers are kept)
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    # "\frac12" -> "\frac{1}{2}", "\sqrt2" -> "\sqrt{2}"
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    if s.startswith("."):
        s = "0" + s
    return s.lower() if re.fullmatch(r"[a-zA-Z]+", s) else s


def _as_number(s: str) -> float | None:
    t = s.replace(",", "")
    try:
        return float(t)
    except ValueError:
        return None


_SAFE_EXPR = re.compile(r"[0-9a-z+\-*/^().\s{}\\]*")


def _to_sympy_text(s: str) -> str | None:
    """`\\frac{a}{b}` -> `(a)/(b)`, `\\sqrt{x}` -> `sqrt(x)`, `^` -> `**`; None if anything else is LaTeX."""
    if len(s) > 64:
        return None
    t = s
    for _ in range(8):
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", t)
        new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", new)
        new = re.sub(r"\^\{([^{}]*)\}", r"^(\1)", new)
        if new == t:
            break
        t = new
    if "\\" in t or "{" in t or "}" in t or not _SAFE_EXPR.fullmatch(t):
        return None
    # only single-letter names (plus sqrt), so no attribute access or arbitrary calls can be formed
    names = re.findall(r"[a-z]+", t)
    if any(len(n) > 1 and n != "sqrt" for n in names):
        return None
    # exponents limited to a 1-2 digit number or one letter, never stacked: "9^9^9" would hang the big-int power
    for k in (m.start() for m in re.finditer(r"\^", t)):
        exp = re.match(r"\^(\((\d{1,2}|[a-z])\)|\d{1,2}(?!\d)|[a-z])", t[k:])
        if exp is None or t[k + len(exp.group(0)) :].lstrip().startswith("^"):
            return None
    return t.replace("^", "**")


def _sympy_equal(a: str, b: str) -> bool:
    ta, tb = _to_sympy_text(a), _to_sympy_text(b)
    if ta is None or tb is None:
        return False
    try:
        import sympy
        from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

        transformations = standard_transformations + (implicit_multiplication_application,)
        ea = parse_expr(ta, transformations=transformations, evaluate=True)
        eb = parse_expr(tb, transformations=transformations, evaluate=True)
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # noqa: BLE001 - anything sympy cannot handle is simply "not equal"
        return False


def is_equiv(prediction: str | None, reference: str | None) -> bool:
    """Whether two final answers agree (normalised string, numeric value, or sympy difference of 0)."""
    if prediction is None or reference is None:
        return False
    a, b = normalize_answer(prediction), normalize_answer(reference)
    if not a or not b:
        return False
    if a == b:
        return True
    na, nb = _as_number(a), _as_number(b)
    if na is not None and nb is not None:
        return abs(na - nb) <= 1e-6 * max(1.0, abs(nb))
    return _sympy_equal(a, b)


def _labels(label) -> list[str]:
    if isinstance(label, (list, tuple)):
        return [str(x) for x in label]
    return [] if label is None else [str(label)]


def math_reward(response: str, label) -> float:
    """`math`: 1.0 when the last `\\boxed{}` of the response equals the label (or one of a list of labels)."""
    answer = last_boxed_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if any(is_equiv(answer, ref) for ref in _labels(label)) else 0.0


def deepscaler_reward(response: str, label) -> float:
    """`deepscaler`: grade the text after `</think>` (or `###Response`); a response with neither scores 0."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    return math_reward(solution, label)
