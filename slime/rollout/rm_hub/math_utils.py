"""Math answer grading at slime's path (`slime.rollout.rm_hub.math_utils`), used by `math`, `deepscaler` and
the `boxed_` prefix.

The grading is the MATH-benchmark one slime uses (Hendrycks' string normalisation, then the PRM800K-style
sympy comparison), with slime's names and results:

- `extract_answer` / `extract_boxed_answer`: the content of the last `\\boxed{...}` (braces balanced);
- `grade_answer_mathd`: equal after `mathd_normalize_answer` (`\\text{}` unwrapped, `_strip_string`:
  `dfrac`/`tfrac`, `\\left`/`\\right`, degrees, `\\$`, a trailing `\\text{ unit}`, `\\%`, `.5` -> `0.5` ->
  `\\frac{1}{2}`, a short `k =` dropped, `\\sqrt2`/`\\frac12` braced, `a/b` -> `\\frac{a}{b}`);
- `grade_answer_sympy`: equal after `_normalize` (units, `$`, `%`, million/billion, LaTeX turned into text by
  pylatexenc, lower case) or, element by element for tuples/intervals, a sympy difference that simplifies
  to 0. An unreduced fraction must match exactly (`2/4` is not `1/2`), and an integer answer must match an
  integer label exactly;
- `grade_answer_verl(response, label)`: both of the above on the response's last boxed answer.

Deliberate differences from slime: a label of integer 0 is graded (slime treats every falsy label as
missing), and `**` counts as `^` in the guard against huge powers (slime only looks for `^`, so `9**9**9`
would hang its sympy call).
"""

from __future__ import annotations

import functools
import re

_BOXED = "\\boxed"
_FBOX = "\\fbox"
_BOXED_OPEN = "\\boxed{"


# ---------------------------------------------------------------------------
# boxed answers
# ---------------------------------------------------------------------------


def closing_brace_index(text: str, start: int) -> int | None:
    """Index of the `}` that brings the brace depth, counted from `start`, back to 0 (None if it never does)."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` of `string` with its wrapper (the last `\\fbox{...}` when there is no `\\boxed`);
    None when there is neither or its braces never close."""
    start = string.rfind(_BOXED)
    if start < 0:
        start = string.rfind(_FBOX)
        if start < 0:
            return None
    end = closing_brace_index(string, start)
    return None if end is None else string[start : end + 1]


def remove_boxed(s: str | None) -> str | None:
    """`\\boxed{x}` -> `x`; None for anything else (an `\\fbox{}`, None, a malformed wrapper)."""
    if isinstance(s, str) and s.startswith(_BOXED_OPEN) and s.endswith("}"):
        return s[len(_BOXED_OPEN) : -1]
    return None


def extract_boxed_answer(solution: str) -> str | None:
    """The content of the last `\\boxed{...}` of `solution`."""
    return remove_boxed(last_boxed_only_string(solution))


def extract_answer(passage: str) -> str | None:
    """The last boxed answer of `passage`, or None when it has no `\\boxed` at all."""
    return extract_boxed_answer(passage) if _BOXED in passage else None


# ---------------------------------------------------------------------------
# Hendrycks' normalisation (grade_answer_mathd)
# ---------------------------------------------------------------------------


def _text_wrapped(answer: str) -> str | None:
    """`x` when `answer` is one `\\text{x}` from start to end, else None."""
    match = re.match(r"\\text\{(.+?)\}$", answer)
    return match.group(1) if match else None


def _brace_fracs(string: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`; a `\\frac` with fewer than two characters after it
    leaves the whole string unchanged."""
    head, *tails = string.split("\\frac")
    out = [head]
    for tail in tails:
        out.append("\\frac")
        if tail[0] == "{":
            out.append(tail)
            continue
        if len(tail) < 2:
            return string
        numerator, rest = tail[0], tail[1:]
        if rest[0] == "{":
            out.append("{" + numerator + "}" + rest)
        else:
            out.append("{" + numerator + "}{" + rest[0] + "}" + rest[1:])
    return "".join(out)


def _slash_to_frac(string: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are integers written plainly."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    return f"\\frac{{{a}}}{{{b}}}" if string == f"{a}/{b}" else string


def _drop_right_units(string: str) -> str:
    """`5\\text{ cm}` -> `5` (a `\\text{ ` with a space only ever introduces a unit in MATH)."""
    if "\\text{ " not in string:
        return string
    parts = string.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError(f"more than one unit in {string!r}")
    return parts[0]


def _brace_sqrts(string: str) -> str:
    """`\\sqrt2` -> `\\sqrt{2}` (one character after a bare `\\sqrt`)."""
    head, *tails = string.split("\\sqrt")
    out = [head]
    for tail in tails:
        out.append("\\sqrt" + (tail if tail[0] == "{" else "{" + tail[0] + "}" + tail[1:]))
    return "".join(out)


def _strip_string(string: str) -> str:
    """Hendrycks' MATH normalisation of a final answer string (raises on a few malformed inputs, e.g. a
    trailing bare `\\sqrt`; `mathd_normalize_answer` then keeps the answer as it was)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac")):
        string = string.replace(old, new)
    for drop in ("\\left", "\\right", "^{\\circ}", "^\\circ", "\\$"):
        string = string.replace(drop, "")
    string = _drop_right_units(string)
    string = string.replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string.startswith("."):
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        string = sides[1]
    string = _brace_sqrts(string)
    string = string.replace(" ", "")
    string = _brace_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _slash_to_frac(string)


def mathd_normalize_answer(answer: str | None) -> str | None:
    """`_strip_string` of the answer with an enclosing `\\text{}` removed; None stays None."""
    if answer is None:
        return None
    answer = answer.strip()
    inner = _text_wrapped(answer)
    if inner is not None:
        answer = inner.strip()
    try:
        return _strip_string(answer)
    except (ValueError, IndexError):
        return answer


def grade_answer_mathd(given_answer: str | None, ground_truth: str | None) -> bool:
    """Equal after Hendrycks' normalisation."""
    return mathd_normalize_answer(ground_truth) == mathd_normalize_answer(given_answer)


# ---------------------------------------------------------------------------
# sympy comparison (grade_answer_sympy)
# ---------------------------------------------------------------------------

# sympy may hang on these, so expressions containing them are never evaluated
BAD_SUBSTRINGS = ["^{", "^("]
BAD_REGEXES = [r"\^[0-9]+\^", r"\^[0-9][0-9]+"]
TUPLE_CHARS = "()[]"

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard")  # fmt: skip
_LATEX_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


@functools.cache
def _sympy():
    """sympy and its parser, imported on the first grade (importing them costs a third of a second, which
    every `train.py` argument parse would pay otherwise)."""
    import sympy
    from sympy.parsing import sympy_parser

    names = {name: value for name, value in vars(sympy).items() if not name.startswith("_")}
    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    return sympy, sympy_parser, names, transformations


@functools.cache
def _latex_to_text():
    from pylatexenc import latex2text

    return latex2text.LatexNodes2Text()


def _sympy_parse(expr: str):
    """Parse with sympy's names only (no Python builtins, so the text cannot reach arbitrary code)."""
    _, sympy_parser, names, transformations = _sympy()
    return sympy_parser.parse_expr(
        expr.replace("^", "**"),
        local_dict={},
        global_dict={"__builtins__": {}, **names},
        transformations=transformations,
    )


def _parse_latex(expr: str) -> str:
    """LaTeX -> plain text sympy can read (`\\frac{1}{2}` -> `1/2`, `\\sqrt{2}` -> `sqrt(2)`, `\\pi` -> `pi`)."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # "1\frac{1}{2}" is a mixed number, not 1 times a half
    text = _latex_to_text().latex_to_text(expr)
    for symbol, name in _LATEX_SYMBOLS:
        text = text.replace(symbol, name)
    return text.strip()


def _is_float(num: str) -> bool:
    try:
        float(num)
    except (TypeError, ValueError):
        return False
    return True


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (TypeError, ValueError, OverflowError):
        return False


def _is_frac(expr: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr) is not None


def _strip_properly_formatted_commas(expr: str) -> str:
    """`1,000,000` -> `1000000`, leaving tuple commas (`(1,2)`) alone."""
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        stripped = pattern.sub(r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _str_is_int(x: str) -> bool:
    try:
        value = float(_strip_properly_formatted_commas(x))
        return abs(value - int(round(value))) <= 1e-7
    except (TypeError, ValueError, OverflowError):
        return False


def _str_to_int(x: str) -> int:
    return int(float(x.replace(",", "")))


def _inject_implicit_mixed_number(step: str) -> str:
    """`7 3/4` -> `7+3/4`."""
    return re.sub(r"([0-9]) +([0-9])", r"\1+\2", step)


def _normalize(expr: str | None) -> str | None:
    """The PRM800K normalisation: a lower-case, space-free plain-text form sympy can parse."""
    if expr is None:
        return None
    inner = _text_wrapped(expr)
    if inner is not None:
        expr = inner
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNITS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _parse_latex(expr)
        except Exception:  # noqa: BLE001 - LaTeX pylatexenc cannot read stays as it is
            pass
    expr = re.sub(r"- *", "-", expr)
    expr = _inject_implicit_mixed_number(expr)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(_str_to_int(expr))
    return expr


def count_unknown_letters_in_expr(expr: str) -> int:
    return len({ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()})


def should_allow_eval(expr: str) -> bool:
    """Whether sympy may evaluate `expr`: at most two unknown letters and no power that could be huge."""
    if count_unknown_letters_in_expr(expr) > 2:
        return False
    powers = expr.replace("**", "^")
    if any(bad in powers for bad in BAD_SUBSTRINGS):
        return False
    return not any(re.search(bad, powers) for bad in BAD_REGEXES)


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str) -> bool:
    expr = f"({ground_truth_normalized})-({given_normalized})"
    if not should_allow_eval(expr):
        return False
    try:
        return _sympy()[0].simplify(_sympy_parse(expr)) == 0
    except Exception:  # noqa: BLE001 - whatever sympy cannot parse or simplify is "not equal"
        return False


def split_tuple(expr: str) -> list[str]:
    """The elements of `(a,b)` / `[a,b)`-style tuples and intervals; any other expression is one element."""
    expr = _strip_properly_formatted_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    bracketed = len(expr) > 2 and expr[0] in TUPLE_CHARS and expr[-1] in TUPLE_CHARS
    if bracketed and not any(c in inner for c in TUPLE_CHARS):
        return [elem.strip() for elem in inner.split(",")]
    return [expr]


def _elements_equal(ground_truth: str, given: str) -> bool:
    if _is_frac(ground_truth) and _is_frac(given):
        return ground_truth == given  # an unreduced fraction is not the reduced one
    if _str_is_int(ground_truth) != _str_is_int(given):
        return False  # an integer answer must be matched by an integer
    return are_equal_under_sympy(ground_truth, given)


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    """Equal after `_normalize`, or element by element under sympy (see the module docstring)."""
    truth, given = _normalize(ground_truth), _normalize(given_answer)
    if truth is None:
        return False
    if truth == given:
        return True
    if not given:
        return False
    truth_elems, given_elems = split_tuple(truth), split_tuple(given)
    if len(truth_elems) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # (a,b) is not [a,b]
    if len(truth_elems) != len(given_elems):
        return False
    return all(_elements_equal(t, g) for t, g in zip(truth_elems, given_elems))


def grade_answer_verl(solution_str: str, ground_truth) -> bool:
    """Whether the last boxed answer of `solution_str` equals `ground_truth` (itself unboxed when boxed)."""
    if ground_truth is None or str(ground_truth) == "":
        return False
    ground_truth = str(ground_truth)
    if _BOXED in ground_truth:
        ground_truth = extract_answer(ground_truth)
    given = extract_answer(solution_str)
    if given is None:
        return False
    return grade_answer_mathd(given, ground_truth) or grade_answer_sympy(given, ground_truth)
