"""The `deepscaler` reward at slime's path (`slime.rollout.rm_hub.deepscaler`): DeepScaleR's rule-based math grader.

Only the solution counts: the text after the last `</think>`, else after the first `###Response`; a response
with neither scores 0 (so a chat template that drops both markers scores every sample 0). Its last
`\\boxed{}` answer is graded against the label (unboxed when boxed) by `grade_answer_mathd` or
`grade_answer_sympy`. Returns 1 or 0.
"""

from __future__ import annotations

from slime.rollout.rm_hub.math_utils import extract_answer, grade_answer_mathd, grade_answer_sympy


def _solution(response: str) -> str | None:
    if "</think>" in response:
        return response.split("</think>")[-1]
    if "###Response" in response:
        return response.split("###Response")[1]
    return None


def get_deepscaler_rule_based_reward(response: str, label) -> int:
    solution = _solution(response)
    if solution is None:
        return 0
    answer = extract_answer(solution)
    if answer is None or label == "":
        return 0
    if not isinstance(label, (str, int, float)):
        raise ValueError(f"deepscaler: the label must be a str, int or float, got {type(label).__name__} {label!r}")
    truth = str(label)
    if "\\boxed" in truth:
        truth = extract_answer(truth)
        if truth is None:
            return 0
    return 1 if grade_answer_mathd(answer, truth) or grade_answer_sympy(answer, truth) else 0
