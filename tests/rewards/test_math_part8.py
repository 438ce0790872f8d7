"""Part 8 of the math-reward issue: the wrong-answer classes an independent labelled set found (thousands
groups inside LaTeX, powers of ten, unions in any order, arithmetic inside \\boxed{}, equation chains, a
parenthesised negative after ####, numbers as words, coordinates as assignments, truncated completions).

``INDEPENDENT`` is a second, separate check: cases written after the fixes, before running them, covering the
classes, neighbouring formats and adversarial completions meant to produce false positives. Labels are truth
decided by reading (1: the completion's final answer is right). Known misses are listed in ``KNOWN_MISSES``
(false negatives only); a false positive fails the suite.
"""

from __future__ import annotations

import pytest

from unialign.rewards import math_compare, math_parse
from unialign.rewards.math import extract_answer, math_accuracy_reward

W = "We set up the problem and simplify.\n\n"
S = "Let me solve this step by step.\n"

# (completion, gold, label)
INDEPENDENT = [
    # thousands groups inside LaTeX
    (W + r"Hence the total is $\boxed{3\,628\,800}$.", "3628800", 1),
    (W + r"Hence the total is $\boxed{3\,628\,800}$.", "362880", 0),
    (W + r"So the answer is $\boxed{0}$.", r"25\,000", 0),
    (W + r"So the answer is $\boxed{384}$.", r"4\,096", 0),
    (S + "There are 4096 subsets.\n#### 4\\,096", "4096", 1),
    (W + r"The number of subsets is $\boxed{1\,024}$.", "2^{10}", 1),
    (W + r"The cost is $\boxed{7{,}500}$.", "7500", 1),
    (W + r"The cost is $\boxed{7{,}500}$.", "7.5", 0),
    (S + "The answer is $1\\,000$.", "1000", 1),
    # powers of ten
    (W + r"There are $\boxed{10^{9}}$ numbers.", "1,000,000,000", 1),
    (W + r"There are $\boxed{10^{9}}$ numbers.", "100,000,000", 0),
    (S + "The colony grows tenfold four times, from 3.\n#### 3 \\times 10^4", "30000", 1),
    (S + "The colony grows tenfold four times, from 3.\n#### 3 \\times 10^4", "3", 0),
    (W + r"The concentration is $\boxed{5\cdot10^{-2}}$.", "0.05", 1),
    (S + "Ten cubed.\n#### 10^3", "30", 0),
    # unions in any order
    (W + r"So $\boxed{(-\infty, -3] \cup [3, \infty)}$.", r"[3,\infty)\cup(-\infty,-3]", 1),
    (W + r"So $\boxed{(-\infty, -3) \cup (3, \infty)}$.", r"[3,\infty)\cup(-\infty,-3]", 0),
    (W + r"So $\boxed{(-\infty,-3]\cup[3,\infty)}$.", r"(-\infty,-3]", 0),
    (W + r"So $\boxed{(0,1) \cup (2,3)}$.", r"(2,3) \cup (0,1)", 1),
    (W + r"So $\boxed{(0,1) \cup (0,1)}$.", r"(0,1) \cup (2,3)", 0),
    # arithmetic inside \boxed{}
    (W + r"The result is $\boxed{50-8}$.", "42", 1),
    (W + r"The result is $\boxed{50-8}$.", "58", 0),
    (W + r"The result is $\boxed{(2+3)*4}$.", "20", 1),
    (W + r"The result is $\boxed{2+3*4}$.", "20", 0),
    (W + r"The result is $\boxed{x+2}$.", "42", 0),
    # equation chains
    (S + "So the answer is 15 + 27 = 42.", "42", 1),
    (S + "Three packs of five.\n#### 3 * 5 = 15", "15", 1),
    (S + "Three packs of five.\n#### 3 * 5 = 15", "3", 0),
    (S + "The answer is 7 \\cdot 8 = 56 cookies.", "56", 1),
    (S + "#### 20 + 5 = 25 = 5^2", "25", 1),
    (S + "The answer is x = 2 + 3 = 5.", "5", 1),
    # parenthesised numbers after ####
    (S + "The balance ends negative.\n#### (-42)", "-42", 1),
    (S + "The balance ends negative.\n#### (42)", "-42", 0),
    (S + "Half a degree colder.\n#### (-0.5)", "-1/2", 1),
    # numbers written as words
    (S + "The answer is seventeen.", "17", 1),
    (S + "The answer is seventy.", "17", 0),
    (S + "#### Twenty-one", "21", 1),
    (S + "The answer is one hundred.", "100", 1),
    (S + "The answer is one hundred.", "1", 0),
    (S + "After 8 days he has twenty left.", "8", 0),
    (S + "She bought 4 bags and gave away half.", "4", 0),
    (S + "The answer is nine thousand and nine.", "9009", 1),
    (S + "#### two thirds", "2/3", 1),
    (S + "The answer is three or four.", "3", 0),
    (S + "The answer is the number three.", "3", 1),
    (S + "The answer is: eight", "8", 1),
    (S + "It is not forty-two.", "42", 0),
    # coordinates as assignments
    (W + r"Thus $\boxed{a = 3, b = -2}$.", "(3,-2)", 1),
    (W + r"Thus $\boxed{b = -2, a = 3}$.", "(3,-2)", 1),
    (W + r"Thus $\boxed{b = -2, a = 3}$.", "(-2,3)", 0),
    (W + "The solution is $(x, y) = (4, 5)$.", "(4,5)", 1),
    (S + "Therefore x = 4, y = 5.", "(4,5)", 1),
    (S + "Therefore x = 4, y = 5.", "(5,4)", 0),
    (W + "So $x = 4$, $y = 5$.", "(4,5)", 1),
    (W + "We get $x=4$ or $x=5$.", "4", 0),
    # truncated completions
    ("There are 6 rows of 4 chairs, so 24 chairs. The teacher then adds", "24", 0),
    ("There are 6 rows of 4 chairs, so 24 chairs", "24", 1),
    ("There are 6 rows of 4 chairs, so 24 chairs in each of", "24", 0),
    ("Mia reads 10 pages a day. After 7 days she has read 70 pages. Next week she plans to", "70", 0),
    ("Mia reads 10 pages a day. After 7 days she has read 70 pages.", "70", 1),
    ("The price was 80 and fell by 20, leaving 60. If we then", "60", 0),
    ("The price was 80 and fell by 20, leaving 60", "60", 1),
    ("The price was 80 and fell by 20, leaving 60 dollars and", "60", 0),
    # more adversarial
    (W + r"So $\boxed{1 000}$.", "1", 0),
    (S + "#### 12 000", "12", 0),
    (W + r"So $\boxed{2 1/2}$.", "21/2", 0),
    (S + "The answer is 5 million dollars.", "5", 0),
    (S + "I think it is 3 + 4 = 7, or maybe 8.", "8", 0),
    (S + "The answer is not 1 + 41 = 42.", "42", 0),
]

# false negatives left alone (never a false positive here)
KNOWN_MISSES = {
    S + "The answer is the number three.",  # "the number three": only a whole number phrase is read
}


def _score(completion: str, gold: str) -> float:
    return math_accuracy_reward([None], [completion], [gold])[0]


@pytest.fixture(scope="module")
def independent_scores():
    return math_accuracy_reward([None] * len(INDEPENDENT), [c for c, _, _ in INDEPENDENT],
                                [g for _, g, _ in INDEPENDENT])


def test_independent_set_is_well_formed():
    assert len(INDEPENDENT) >= 40
    assert sum(label == 0 for _, _, label in INDEPENDENT) >= 20  # enough chances for a false positive
    assert all(label == 1 for c, _, label in INDEPENDENT if c in KNOWN_MISSES)


def test_independent_set_has_no_false_positive(independent_scores):
    false_pos = [(c[-60:], g) for (c, g, label), s in zip(INDEPENDENT, independent_scores)
                 if s == 1.0 and label == 0]
    assert false_pos == []


def test_independent_set_agreement(independent_scores):
    misses = {c for (c, _, label), s in zip(INDEPENDENT, independent_scores) if s != label}
    assert misses == KNOWN_MISSES


# ---- class by class: the rule each fix adds -------------------------------------------------------

@pytest.mark.parametrize("completion, gold, expected", [
    (r"\boxed{1\,000\,000}", "1000000", 1.0), (r"\boxed{1{,}000{,}000}", "1000000", 1.0),
    (r"\boxed{1,000,000}", "1000000", 1.0), (r"\boxed{10,\!000}", "10000", 1.0),
    (r"\boxed{0}", r"1\,000\,000", 0.0), (r"\boxed{0}", r"1\,000", 0.0), (r"\boxed{500}", r"1\,500", 0.0),
    (r"\boxed{1000000}", r"1\,000\,000", 1.0), ("#### 1 000 000", "1000000", 1.0),
    ("#### 2 100", "2100", 1.0),
])
def test_thousands_groups(completion, gold, expected):
    assert _score(completion, gold) == expected


def test_two_numbers_side_by_side_are_no_product():
    with pytest.raises(math_parse.ParseError):
        math_parse.parse("1 000")
    assert math_parse.exact_value(math_parse.parse(r"\log_2 8")) is None  # a subscript is not "side by side"
    assert math_compare.join_thousands(r"1\,000\,000 and 12 34") == "1000000 and 12 34"
    assert math_compare.compare("6", r"2\,3") is False and math_compare.compare("21/2", "2 1/2") is False


@pytest.mark.parametrize("completion, gold, expected", [
    (r"\boxed{10^6}", "1,000,000", 1.0), (r"\boxed{10^{6}}", r"1\,000\,000", 1.0),
    (r"\boxed{1\times 10^6}", "1000000", 1.0), ("#### 2 x 10^3", "2000", 1.0), ("#### 10⁶", "1000000", 1.0),
    ("The answer is 1 million.", "1000000", 1.0), ("The answer is 1 million.", "1", 0.0),
    ("#### 2.5 thousand", "2500", 1.0), ("So it is 10⁶.", "10", 0.0), (r"\boxed{10^6}", "10^5", 0.0),
])
def test_powers_of_ten(completion, gold, expected):
    assert _score(completion, gold) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    (r"\boxed{(-\infty,0)\cup(1,\infty)}", r"(1,\infty)\cup(-\infty,0)", 1.0),
    (r"\boxed{(1,\infty)\cup(-\infty,0]}", r"(-\infty,0)\cup(1,\infty)", 0.0),
    (r"\boxed{(1,2)\cup(1,2)}", r"(1,2)\cup(3,4)", 0.0),
    (r"\boxed{(1,2)}", r"(1,2)\cup(3,4)", 0.0),
    (r"\boxed{\{5\}\cup[1,2]}", r"[1,2]\cup\{5\}", 1.0),
])
def test_unions_are_sets_of_pieces(completion, gold, expected):
    assert _score(completion, gold) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    (r"\boxed{40+2}", "42", 1.0), (r"\boxed{40+2}", "40", 0.0), (r"\boxed{(40+2, 1)}", "(42, 1)", 1.0),
    (r"The answer is $40+2$.", "42", 1.0),
    ("#### 40+2", "42", 0.0),                   # a #### line needs a plain number (GSM8K convention)
    ("So we compute $40+2$.", "42", 0.0),      # a trailing region is no marked answer
    (r"\boxed{40+2\%}", "42", 0.0),             # a percent sign turns value comparison off
])
def test_boxed_arithmetic_by_value(completion, gold, expected):
    assert _score(completion, gold) == expected


def test_plain_arithmetic_still_not_a_number():
    assert not math_compare.compare("2+2", "4")
    assert math_compare.compare("2+2", "4", by_value=True) is True


@pytest.mark.parametrize("completion, answer", [
    ("#### 6*7=42", "42"), ("The answer is 1 + 41 = 42.", "42"), (r"\boxed{6 \times 7 = 42}", "42"),
    ("#### 42 = 6*7", "42"), ("#### x = 6 * 7 = 42", "x = 42"), (r"\boxed{x = 5}", "x = 5"),
    (r"\boxed{2x = 10}", "2x = 10"), (r"\boxed{f(2) = 5}", "f(2) = 5"),
])
def test_equation_chains(completion, answer):
    assert extract_answer(completion) == answer


def test_gold_chain_is_left_alone():
    assert math_accuracy_reward([None], ["#### 4"], ["#### 2+2=4"]) == [0.0]


@pytest.mark.parametrize("completion, gold, expected", [
    ("#### (-5)", "-5", 1.0), ("#### (-5)", "5", 0.0), ("#### (5)", "5", 1.0), ("#### (−8)", "-8", 1.0),
])
def test_parenthesised_number(completion, gold, expected):
    assert _score(completion, gold) == expected


@pytest.mark.parametrize("text, value", [
    ("forty-two", 42), ("zero", 0), ("negative 5", -5), ("minus five", -5), ("one hundred and five", 105),
    ("twelve hundred", 1200), ("a dozen", 12), ("three quarters", 0.75), ("one and a half", 1.5),
    ("1.5 million", 1500000), ("twelve apples", 12),
    ("two five", None), ("forty twelve", None), ("twelve or thirteen", None), ("forty, two", None),
    ("one of them", None), ("5", None), ("three times", None), ("two third", None), ("the answer", None),
])
def test_word_numbers(text, value):
    assert math_compare.word_number(text) == value


@pytest.mark.parametrize("completion, gold, expected", [
    ("The answer is twelve.", "12", 1.0), ("#### zero", "0", 1.0), ("#### negative 5", "-5", 1.0),
    (r"\boxed{\text{five}}", "5", 1.0), ("#### 5", r"\text{five}", 0.0),   # a gold word stays text
    ("She has twelve.", "12", 0.0),               # words are read only in an answer slot
    ("He had 5 apples and ate two.", "5", 0.0),   # a number word after the last digits: abstain
])
def test_word_answers(completion, gold, expected):
    assert _score(completion, gold) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    (r"\boxed{y = 2, x = 1}", "(1,2)", 1.0), (r"\boxed{y = 2, x = 1}", "(2,1)", 0.0),
    ("So $x = 1$ and $y = 2$.", "(1,2)", 1.0), ("Thus x = 1 and y = 2.", "(1,2)", 1.0),
    ("Thus x = 1 and y = 2.", "2", 0.0),          # several values against one gold
    ("So x = 1 or x = 2.", "2", 0.0),             # a hedge
    (r"\boxed{x = 1, x = 2}", "1, 2", 1.0),
])
def test_coordinates(completion, gold, expected):
    assert _score(completion, gold) == expected


@pytest.mark.parametrize("completion, expected", [
    ("Tom has 3 apples. He buys 5 more so he has 8. Then he gives away", None),
    ("He buys 5 more so he has 8 and then he gives", None),
    ("He has 8 apples, then", None), ("The total is 8.\n\nNow let's check:", None),
    ("so he covers 180 miles", "180"), ("so she has 3/4 of the cake left", "3/4"),
    ("Then he gives away 2, so he has 6", "6"), ("He has **8 apples**", "8"),
    ("He has 8 apples.</think>", "8"), ("He has 8. I hope this helps!", "8"),
])
def test_truncated_completions(completion, expected):
    assert extract_answer(completion) == expected
