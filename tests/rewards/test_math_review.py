"""Regression tests for the adversarial review of the math reward: false positives first (wrong answers that
scored 1.0), then false negatives. Labels decided by reading; the labelled set has the same cases in context."""

from __future__ import annotations

import pytest

from unialign.rewards import math_compare, math_parse
from unialign.rewards.math import extract_answer, math_accuracy_reward


def _score(completion: str, gold: str) -> float:
    return math_accuracy_reward([None], [completion], [gold])[0]


@pytest.mark.parametrize("completion,gold,expected", [
    # words are text (case-insensitive), never a product of letters
    (r"\boxed{\text{on}}", r"\text{no}", 0.0), (r"\boxed{ba}", "ab", 0.0), (r"\boxed{CA}", "AC", 0.0),
    (r"\boxed{\text{no}}", r"\text{No}", 1.0), (r"\boxed{No}", "no", 1.0), (r"\boxed{\text{NO}}", r"\text{no}", 1.0),
    (r"\boxed{xy}", "yx", 1.0), (r"\boxed{\pi}", "pi", 0.0),
    # a mixed number is an integer directly followed by \frac, never through brackets
    (r"\boxed{2\left(\frac{1}{2}\right)}", r"\frac52", 0.0), (r"\boxed{2 (\frac{1}{2})}", r"\frac52", 0.0),
    (r"\boxed{2\frac{1}{2}}", r"\frac52", 1.0), (r"\boxed{2 \frac{1}{2}}", r"\frac52", 1.0),
    # identities must hold at negative points too
    (r"\boxed{|x|}", "x", 0.0), (r"\boxed{\sqrt{x^2}}", "x", 0.0), (r"\boxed{\ln(x^2)}", r"2\ln x", 0.0),
    (r"\boxed{\sqrt[3]{x^3}}", "x", 1.0), (r"\boxed{x^{1/3}}", r"\sqrt[3]{x}", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    # near ties are not equal
    (r"\boxed{\sqrt{1000000000001}}", "1000000", 0.0), (r"\boxed{\pi + 10^{-10}}", r"\pi", 0.0),
    (r"\boxed{e^{-100}}", "0", 0.0), (r"\boxed{\frac{1}{\sqrt2}}", r"\frac{\sqrt2}{2}", 1.0),
    # a different variable, a negated or uncertain last number
    (r"\boxed{y = 5}", "x=5", 0.0), (r"\boxed{x = 5}", "x=5", 1.0),
    ("It is not 42.", "42", 0.0), ("I cannot determine the answer. Maybe 42?", "42", 0.0),
    ("She does not need more boxes. She packs 6 boxes of 7, so she has 42.", "42", 1.0),
    # false negatives
    (r"\boxed{\emptyset}", r"\varnothing", 1.0), (r"\boxed{|-5|}", "5", 1.0), (r"\boxed{|-5|}", "-5", 0.0),
    (r"\boxed{\lfloor 2.5\rfloor}", "2", 1.0), (r"\boxed{\lceil 2.5\rceil}", "2", 0.0),
    (r"\boxed{\lfloor x\rfloor}", "x", 0.0), (r"\boxed{x \in (1,2)}", "(1,2)", 1.0),
    ("#### 12 (3 boxes of 4)", "12", 1.0), ("#### 13 (3 boxes of 4)", "12", 0.0),
    ("The answer is 12 apples and 3 pears.", "12", 1.0), ("The answer is 12 or 13.", "12", 0.0),
])
def test_review_cases(completion, gold, expected):
    assert _score(completion, gold) == expected


def test_mixed_number_only_without_brackets():
    assert math_parse.exact_value(math_parse.parse(r"2\frac{1}{2}")) == 2.5
    assert math_parse.exact_value(math_parse.parse(r"2(\frac{1}{2})")) == 1
    assert math_parse.exact_value(math_parse.parse(r"2\left(\frac{1}{2}\right)")) == 1


def test_near_ties_go_to_the_symbolic_tier():
    tree = math_parse.parse
    assert math_parse.same_value(tree(r"\sqrt{1000000000001}"), tree("1000000")) is None
    assert math_parse.same_value(tree(r"\pi + 10^{-10}"), tree(r"\pi")) is None
    assert math_parse.same_value(tree("|x|"), tree("x")) is False
    assert math_compare.compare(r"\sqrt{1000000000001}", "1000000") is None  # decided by sympy, not here


def test_word_answers():
    assert math_compare.compare("on", r"\text{no}") is False
    assert math_compare.compare(r"\text{Monday}", "monday") is True
    assert extract_answer("Maybe 42?") is None and extract_answer("It is not 42.") is None
