"""Tests for the verifiable math rewards: answer extraction, exact number parsing, comparison, format,
and hostile inputs that must neither run code nor hang (each checked against a 1 s wall clock)."""

from __future__ import annotations

import builtins
import time
from fractions import Fraction

import pytest

import unialign.rewards.math as math_rewards
from unialign.rewards.math import (
    answers_equal,
    extract_answer,
    math_accuracy_reward,
    math_format_reward,
    normalize_answer,
    parse_number,
    reference_answer,
)

GSM8K_REFERENCE = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def accuracy(completion, answer):
    return math_accuracy_reward([None], [completion], [answer])[0]


# ---- extraction ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("#### 1,000", "1,000"),
    ("First 3 then 4.\n#### 5\nI am confident, 7 times over.", "5"),   # #### beats a later number
    ("#### 3\nwait, recheck\n#### 4", "4"),                             # last #### wins
    ("#### 6 ####", "6"),                                               # empty last ####: fall back
    ("so \\boxed{1} no, \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),          # last \boxed, nested braces
    ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
    ("\\boxed 5$", "5"),
    ("The answer is 42.", "42"),
    ("We get 1, 2 and finally −5", "-5"),                                # unicode minus
    ("5-3 = 2 and 10-7", "7"),                                          # a binary minus is not a sign
    ("x = -5", "-5"),
    ("about 3 / 4 of them", "3 / 4"),
    ("it is $1,234.50 total", "1,234.50"),
    ("so it is \\dfrac{7}{8}", "\\dfrac{7}{8}"),
    ("2.5e3 meters", "2.5e3"),
    ("no digits here", None),
    ("so it is 10^5", None),                                            # exponents are not evaluated
    ("so it is 10^{5}", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_malformed_markers_do_not_fall_back():
    assert extract_answer("the answer is 9 \\boxed{9") is None        # unbalanced last \boxed
    assert extract_answer("#### " + "x" * 2000 + " 9") is None         # #### line too long
    assert extract_answer("The answer is 42.", last_number=False) is None
    assert extract_answer(None) is None


def test_reference_answer_forms():
    assert reference_answer(GSM8K_REFERENCE) == "72"
    assert reference_answer("so $\\boxed{\\frac{1}{2}}$") == "\\frac{1}{2}"
    assert reference_answer(" 72 ") == "72"
    assert reference_answer(72) == "72"
    assert reference_answer("x^2+1") == "x^2+1"      # a bare non-numeric reference is kept whole
    assert reference_answer(None) is None and reference_answer("") is None


# ---- exact numbers -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("42", Fraction(42)), ("-5", Fraction(-5)), ("−5", Fraction(-5)), ("+5", Fraction(5)),
    ("5.0", Fraction(5)), ("5.", Fraction(5)), (".5", Fraction(1, 2)), ("0.75", Fraction(3, 4)),
    ("1,234", Fraction(1234)), ("1,234,567.5", Fraction(2469135, 2)), ("$1,000", Fraction(1000)),
    ("1{,}000", Fraction(1000)), ("1\\,000", Fraction(1000)), ("42.", Fraction(42)), ("50%", Fraction(50)),
    ("3/4", Fraction(3, 4)), ("-3 / 4", Fraction(-3, 4)), ("1.5/3", Fraction(1, 2)),
    ("\\frac{3}{4}", Fraction(3, 4)), ("\\dfrac{-3}{4}", Fraction(-3, 4)), ("-\\tfrac{3}{4}", Fraction(-3, 4)),
    ("\\frac34", Fraction(3, 4)), ("{7}", Fraction(7)), ("{{7}}", Fraction(7)),
    ("2.5e-3", Fraction(1, 400)), ("1E3", Fraction(1000)), ("1.5 \\times 10^{3}", Fraction(1500)),
    ("007", Fraction(7)),
])
def test_parse_number_accepts(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("text", [
    "", "-", ".", "abc", "1,5", "12,34", "1/0", "\\frac{1}{0}", "3 4", "2+2", "9**9**9", "9^9", "1e999999999",
    "1e401", "1e-401", "1" * 201, "inf", "nan", "0x10", "1_000", "٤٢", "__import__('os')", "{3}{4}", None, 5,
])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


# ---- comparison ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prediction, reference", [
    ("\\frac{3}{4}", "0.75"), ("-5", "−5"), ("5.0", "5"), ("1,000", "1000"), ("$18", "18"),
    ("72 \\text{ apples}", "72"), ("72 clips.", "72"), ("x = 5", "5"), ("90^\\circ", "90"),
    ("\\text{Monday}", "Monday"), ("\\left( 1, 2 \\right)", "(1,2)"), ("\\dfrac{\\pi}{2}", "\\frac{\\pi}{2}"),
])
def test_answers_equal(prediction, reference):
    assert answers_equal(prediction, reference)


@pytest.mark.parametrize("prediction, reference", [
    ("0.333", "1/3"), ("5x", "5"), ("9**9", "9"), ("2+2", "4"), ("-5", "5"), ("5", "\\text{five}"),
    ("", ""), ("x" * 1001, "x" * 1001),
])
def test_answers_not_equal(prediction, reference):
    assert not answers_equal(prediction, reference)


def test_normalize_answer():
    assert normalize_answer("$\\text{ 12 } \\%$.") == "12"
    assert normalize_answer("  ") is None


# ---- rewards -------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, answer, expected", [
    ("48/2 = 24, 48 + 24 = 72\n#### 72", GSM8K_REFERENCE, 1.0),
    ("so 72 clips\n#### 1,000", "1000", 1.0),
    ("I think \\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("The answer is 42.", "42", 1.0),
    ("The answer is 42 and then 43", "42", 0.0),          # last number, not the first
    ("#### 5\nhmm, maybe 7", "7", 0.0),                    # the #### answer counts
    ("answer: −5", "-5", 1.0),
    ("#### 5.0", "5", 1.0),
    ("no answer at all", "5", 0.0),
    ("#### 5", None, 0.0),
    ([{"role": "assistant", "content": "#### 72"}], GSM8K_REFERENCE, 1.0),
])
def test_math_accuracy_reward(completion, answer, expected):
    assert accuracy(completion, answer) == expected


def test_math_accuracy_strict_and_extra_columns():
    out = math_accuracy_reward(["q", "q"], ["The answer is 4.", "#### 4"], ["4", "4"], last_number=False,
                               difficulty=[1, 2], completion_ids=[[1], [2]])
    assert out == [0.0, 1.0]
    with pytest.raises(ValueError, match="1 answers for 2 completions"):
        math_accuracy_reward(["q", "q"], ["a", "b"], ["4"])


@pytest.mark.parametrize("completion, expected", [
    ("Step 1...\n#### 72", 1.0), ("#### 72\n\n", 1.0), ("  #### -3/4", 1.0), ("#### $1,000.", 1.0),
    ("#### 72\nthe end", 0.0), ("####72", 0.0), ("#### seventy-two", 0.0), ("#### 9**9**9**9", 0.0),
    ("The answer is 72", 0.0), ("", 0.0), ([{"role": "assistant", "content": "x\n#### 2"}], 1.0),
])
def test_math_format_reward_gsm8k(completion, expected):
    assert math_format_reward([None], [completion]) == [expected]


@pytest.mark.parametrize("completion, expected", [
    ("<think>add</think><answer>72</answer>", 1.0),
    ("\n<think>\nadd\n</think>\n<answer>\n72\n</answer>\n", 1.0),
    ("<think>add</think><answer> </answer>", 0.0),
    ("<answer>72</answer><think>add</think>", 0.0),
    ("<think>a</think>junk<answer>72</answer>", 0.0),
    ("<think>a</think><answer>72</answer> trailing", 0.0),
    ("<think><think>a</think><answer>72</answer>", 0.0),
    ("#### 72", 0.0),
])
def test_math_format_reward_think_answer(completion, expected):
    assert math_format_reward([None], [completion], style="think_answer") == [expected]
    with pytest.raises(ValueError, match="style"):
        math_format_reward([None], [completion], style="xml")


# ---- hostile inputs ------------------------------------------------------------------------------

HOSTILE = {
    "python_injection": "__import__('os').system('rm -rf /')",
    "boxed_injection": "\\boxed{__import__('os').system('echo pwned')}",
    "power_tower": "#### 9**9**9**9",
    "huge_exponent": "1e99999999",
    "huge_exponent_answer": "#### 1e99999999",
    "million_digits": "9" * 1_000_000,
    "million_digits_answer": "#### " + "9" * 1_000_000,
    "deep_braces": "\\boxed" + "{" * 100_000,
    "deep_closed_braces": "\\boxed" + "{" * 100_000 + "9" + "}" * 100_000,
    "many_hashes": "####" * 100_000,
    "many_hash_lines": "#### \n" * 100_000,
    "many_commas": "1," * 400_000,
    "many_fracs": "\\frac{" * 100_000,
    "many_texts": "\\boxed{" + "\\text{" * 100_000 + "9}",
    "many_numbers": "9 " * 500_000 + "/",
    "think_tags": "<think>" * 100_000,
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_inputs_are_fast_and_score_zero(name):
    text = HOSTILE[name]
    t0 = time.perf_counter()
    acc = math_accuracy_reward([None, None], [text, "#### 9"], ["9", text])  # hostile completion / reference
    fmt = math_format_reward([None], [text]) + math_format_reward([None], [text], style="think_answer")
    extract_answer(text)
    parse_number(text)
    assert time.perf_counter() - t0 < 1.0, name
    assert fmt == [0.0, 0.0]
    if name != "many_numbers":  # its last number is a genuine 9
        assert acc[0] == 0.0
    assert acc[1] == 0.0


def test_no_eval_or_exec_anywhere(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec/compile called on model output")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    texts = list(HOSTILE.values())[:6] + ["#### 2+2", "\\boxed{1+1}", "#### 72"]
    assert math_accuracy_reward([None] * len(texts), texts, ["4"] * 8 + ["72"]) == [0.0] * 8 + [1.0]
    assert math_format_reward([None], ["#### __import__('os')"]) == [0.0]


def test_timed_out_sample_scores_zero(monkeypatch):
    original = math_rewards._score

    def slow_on_marker(item):
        if "SLOW" in item[0]:
            time.sleep(0.5)
        return original(item)

    monkeypatch.setattr(math_rewards, "_score", slow_on_marker)
    t0 = time.perf_counter()
    out = math_accuracy_reward([None] * 3, ["#### 1", "SLOW #### 2", "#### 3"], ["1", "2", "3"], timeout_s=0.05)
    assert out == [1.0, 0.0, 1.0]
    assert time.perf_counter() - t0 < 0.4
