"""The rule-based graders at slime's paths, graded as slime grades: math (mathd + sympy), dapo, deepscaler, f1, gpqa.

Each case is a closed expectation; the ones where we differ from slime on purpose say so.
"""

from __future__ import annotations

import pytest

from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.f1 import f1_score, normalize_answer
from slime.rollout.rm_hub.gpqa import DEFAULT_VALID_LETTERS, _extract_letter_from_response, compute_gpqa_reward
from slime.rollout.rm_hub.math_dapo_utils import compute_score, is_correct_minerva, normalize_final_answer
from slime.rollout.rm_hub.math_dapo_utils import last_boxed_only_string as dapo_last_boxed
from slime.rollout.rm_hub.math_dapo_utils import remove_boxed as dapo_remove_boxed
from slime.rollout.rm_hub.math_utils import (
    _normalize,
    _strip_string,
    extract_answer,
    extract_boxed_answer,
    grade_answer_mathd,
    grade_answer_sympy,
    grade_answer_verl,
    last_boxed_only_string,
    should_allow_eval,
    split_tuple,
)

# --- boxed answers -------------------------------------------------------------------------------------------


def test_boxed_extraction():
    assert extract_boxed_answer(r"first \boxed{1} then \boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert extract_boxed_answer(r"\boxed{unclosed") is None
    # \fbox is found but only a \boxed{} wrapper is removed; "\boxed 7" has no braces
    assert last_boxed_only_string(r"\fbox{x^{2}}") == r"\fbox{x^{2}}"
    assert extract_boxed_answer(r"\fbox{x^{2}}") is None
    assert extract_boxed_answer(r"so \boxed 7$ done") is None
    assert extract_answer(r"\fbox{3}") is None  # no "\boxed" at all
    # dapo's own extraction only knows \boxed{ and raises on a malformed wrapper
    assert dapo_last_boxed(r"\fbox{3}") is None
    with pytest.raises(AssertionError, match="box error: 3"):
        dapo_remove_boxed("3")


# --- math: grade_answer_verl ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given,label,equal",
    [
        (r"\frac{1}{2}", "0.5", True),  # 0.5 is rewritten to \frac{1}{2}
        (r"\dfrac12", r"\frac{1}{2}", True),
        (r"\frac{2}{4}", r"\frac{1}{2}", False),  # an unreduced fraction is not the reduced one
        ("2/4", "1/2", False),
        (r"\text{(A)}", "A", True),  # sympy sees the same symbol a
        (r"\$10", "10", True),
        (r"10\text{ cm}", "10", True),  # a trailing "\text{ unit}" is dropped
        ("12 inches", "12", True),
        (r"50\%", "50", True),
        (r"90^\circ", "90", True),
        ("1,000", "1000", True),
        ("x = 3", "3", True),
        (r"2\sqrt{2}", r"\sqrt{8}", True),
        ("1+x^2", r"x^{2}+1", True),
        (r"\text{Paris}", "paris", True),
        ("(1,2)", "(1, 2)", True),
        ("[1,2]", "(1,2)", False),  # an interval's brackets must match
        ("1.5", "3/2", True),
        ("1.5", "2", False),  # an integer label needs an integer answer
        ("7 3/4", "31/4", True),  # a mixed number
        ("5", "6", False),
        ("9^9^9^9", "1", False),  # stacked powers are never evaluated
        ("9**9**9", "1", False),  # nor written with ** (slime would hang here)
        ("__import__('os')", "0", False),  # too many letters to be evaluated at all
    ],
)
def test_grade_answer_verl(given, label, equal):
    assert grade_answer_verl(rf"so the answer is \boxed{{{given}}}.", label) is equal


def test_grade_answer_verl_labels():
    assert grade_answer_verl(r"\boxed{4}", r"the answer: \boxed{4}") is True  # a boxed label is unboxed
    assert grade_answer_verl("4", "4") is False  # no boxed answer, no credit
    assert grade_answer_verl(r"\boxed{4}", "") is False
    assert grade_answer_verl(r"\boxed{4}", None) is False
    assert grade_answer_verl(r"\boxed{4}", 4) is True
    assert grade_answer_verl(r"\boxed{0}", 0) is True  # slime treats the falsy label 0 as missing


def test_normalisations():
    assert _strip_string(r"\left( \frac12, .5 \right)") == r"(\frac{1}{2},0.5)"
    assert _strip_string("k = 7") == "7"
    assert _strip_string("abc = 7") == "abc=7"  # only a 1-2 character left side is dropped
    assert _strip_string(r"\sqrt3") == r"\sqrt{3}"
    assert _strip_string("-3/4") == r"\frac{-3}{4}"
    assert _normalize(r"\frac{1}{2}") == "1/2"
    assert _normalize("3 feet") == "3"
    assert _normalize("1 and 2") == "1,2"
    assert _normalize(r"\text{Hello}") == "hello"
    assert split_tuple("(1,000,2)") == ["1000", "2"]
    assert split_tuple("((1,2))") == ["((1,2))"]
    assert grade_answer_mathd(r"\text{42}", "42") is True
    assert grade_answer_sympy("x+1", "1+x") is True
    assert should_allow_eval("(x)-(y)") and not should_allow_eval("(x)-(yz)")
    assert not should_allow_eval("2^{10}") and not should_allow_eval("2^10")


# --- dapo ----------------------------------------------------------------------------------------------------


def test_dapo_compute_score():
    assert compute_score("work...\nAnswer: $1,000$", "1000") == {"score": 1.0, "acc": True, "pred": "1000"}
    assert compute_score("Answer: 7", r"\boxed{8}") == {"score": -1.0, "acc": False, "pred": "7"}
    assert compute_score("no final line", "3") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert compute_score("Answer: 3" + " " * 400, "3")["acc"] is False  # only the last 300 characters count
    assert compute_score("Answer: 42<|im_end|>", "42.0")["acc"] is True  # end tokens dropped, the label read as int
    # strict box: the last 100 characters, the boxed content compared as it is
    assert compute_score(r"so \boxed{42}", "42", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "42"}
    assert compute_score(r"\boxed{42}" + "." * 150, "42", strict_box_verify=True)["pred"] is None
    assert compute_score(r"\boxed{ 42}", "42", strict_box_verify=True)["acc"] is False


def test_dapo_normalisation():
    assert normalize_final_answer(r"x = \boxed{\text{12}} dollars") == "12"
    assert normalize_final_answer(r"\boxed{1}+\boxed{2}") == "1}+\\boxed{2"  # the boxed unwrap is greedy, as slime's
    assert normalize_final_answer(r"\frac12") == r"\frac{1}{2}"
    assert normalize_final_answer("the 5 students") == "the5"
    correct, pred = is_correct_minerva("Answer: 41\nanswer : 42", "42")
    assert (correct, pred) == (True, "42")


def test_dapo_non_integer_label_is_an_error():
    with pytest.raises(ValueError, match=r"dapo: label '3\.7' is not an integer.*--rm-type math"):
        compute_score("Answer: 3", "3.7")
    with pytest.raises(ValueError, match="is not an integer"):
        compute_score("Answer: 1/2", r"\frac{1}{2}")


# --- deepscaler ----------------------------------------------------------------------------------------------


def test_deepscaler():
    assert get_deepscaler_rule_based_reward(r"<think>maybe \boxed{5}</think> so \boxed{4}", "4") == 1
    assert get_deepscaler_rule_based_reward(r"<think>\boxed{4}</think> \boxed{5}", "4") == 0
    assert get_deepscaler_rule_based_reward(r"###Response \boxed{4}", "4") == 1
    assert get_deepscaler_rule_based_reward(r"\boxed{4}", "4") == 0  # neither </think> nor ###Response
    assert get_deepscaler_rule_based_reward(r"</think>\boxed{4}", "") == 0
    assert get_deepscaler_rule_based_reward(r"</think>\boxed{4}", 4.0) == 1
    assert get_deepscaler_rule_based_reward(r"</think>\boxed{2/4}", r"\boxed{\frac{1}{2}}") == 0
    with pytest.raises(ValueError, match="deepscaler: the label must be a str, int or float, got NoneType"):
        get_deepscaler_rule_based_reward(r"</think>\boxed{4}", None)


# --- f1 ------------------------------------------------------------------------------------------------------


def test_f1_score():
    assert normalize_answer("The Cat, sat!") == "cat sat"
    f1, precision, recall = f1_score("The cat sat", "cat sat on mat")
    assert (precision, recall) == (1.0, 0.5) and f1 == pytest.approx(2 / 3)
    assert f1_score("nothing", "cat") == (0, 0, 0)
    assert f1_score(None, "cat") == (0, 0, 0)
    # yes / no / noanswer must match exactly on either side
    assert f1_score("yes", "yes") == (1.0, 1.0, 1.0)
    assert f1_score("no", "no way") == (0, 0, 0)
    assert f1_score("yes indeed", "yes") == (0, 0, 0)
    # the whole response is compared: reasoning is not stripped
    assert f1_score("<think>x</think> cat", "cat")[0] == pytest.approx(2 / 3)


# --- gpqa ----------------------------------------------------------------------------------------------------


def test_gpqa_letter_extraction():
    assert DEFAULT_VALID_LETTERS == list("ABCDEFGHIJ")
    assert _extract_letter_from_response("Thinking...</think>The final answer is H.", DEFAULT_VALID_LETTERS) == "H"
    assert _extract_letter_from_response("B is the correct one", "ABCD") == "B"
    assert _extract_letter_from_response("either A or B, I go with D", "ABCD") == "D"
    assert _extract_letter_from_response("answer: E", "ABCD") is None
    # the letter after "answer is" must stand alone (slime reads "I" here, and "C" from "clearly")
    assert _extract_letter_from_response("The answer is (C).", DEFAULT_VALID_LETTERS) == "C"
    assert _extract_letter_from_response("The answer is clearly B", DEFAULT_VALID_LETTERS) == "B"


def test_gpqa_reward():
    assert compute_gpqa_reward("The answer is C.", "C") == 1.0
    assert compute_gpqa_reward(r"\boxed{B}", 1) == 1.0  # an integer label indexes the valid letters
    assert compute_gpqa_reward("I pick B", 2) == 0.0
    assert compute_gpqa_reward("Answer: J", "J") == 1.0  # A-J are valid without choices
    assert compute_gpqa_reward(None, "A") == 0.0
    choices = {"choices": ["rome", "paris", "oslo", "bern"]}
    assert compute_gpqa_reward("it is Paris", "paris", choices) == 1.0  # the choice's text, no letter
    assert compute_gpqa_reward("Answer: B", "Paris!", choices) == 1.0  # the label names choice B
    assert compute_gpqa_reward("Answer: E", "B", choices) == 0.0  # only A-D are valid with 4 choices
    assert compute_gpqa_reward("Answer: a", "anything", {"correct_letter": "a"}) == 1.0
    assert compute_gpqa_reward("Answer: A", 1, {"correct_letter": "A"}) == 0.0  # an integer label wins
    assert compute_gpqa_reward("so, X", "X", {"valid_letters": ["x", "y"]}) == 1.0
    assert compute_gpqa_reward("obviously oslo", "C", {"choices": {"a": "rome", "b": "paris", "c": "oslo"}}) == 1.0
    assert compute_gpqa_reward("no idea", "some answer") == 0.0
