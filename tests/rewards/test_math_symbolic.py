"""The math reward's comparison tiers: the bounded LaTeX grammar (math_parse), structured answers and
conventions (math_compare), extraction fixes, TRL's ``solution`` column, and the sympy worker process with its
hard time limit, tree caps and text-evaluation guard."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from unialign.rewards import get_reward, math_compare, math_parse, math_worker
from unialign.rewards.math import answers_equal, extract_answer, math_accuracy_reward, normalize_answer


def acc(completion, gold, **kw):
    return math_accuracy_reward([None], [completion], [gold], **kw)[0]


# ---- the in-process grammar ----------------------------------------------------------------------

@pytest.mark.parametrize("a, b, equal", [
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", True), ("2\\frac{1}{2}", "\\frac52", True),
    ("2\\sqrt2", "\\sqrt{8}", True), ("\\sqrt[3]{16}", "2\\sqrt[3]{2}", True), ("x^2+2x+1", "(x+1)^2", True),
    ("\\frac{x^2-1}{x-1}", "x+1", True), ("\\pi r^2", "r^2\\pi", True), ("\\sin^2 x+\\cos^2 x", "1", True),
    ("\\log_2 8", "3", True), ("2\\ln 2", "\\ln 4", True), ("|x-1|", "|1-x|", True), ("e^{2}", "e^2", True),
    ("2^{100}+1", "2^{100}", False), ("\\frac{2^{100}}{2^{99}}", "2", True), ("x^2+1", "x^2-1", False), ("3\\sqrt2", "2\\sqrt3", False), ("a^2b", "ab^2", False), ("\\pi", "3.14", False),
])
def test_grammar_same_value(a, b, equal):
    assert math_parse.same_value(math_parse.parse(a), math_parse.parse(b)) is equal


@pytest.mark.parametrize("text", [
    "9**9", "2+", "(" * 100 + "1" + ")" * 100, "1+" * 300 + "1", "200!", "\\frac{1}", "x^", "__import__('os')",
    "\\unknowncommand{1}", "a" * 500,
])
def test_grammar_refuses(text):
    with pytest.raises(math_parse.ParseError):
        math_parse.parse(text)


def test_grammar_values_are_bounded():
    assert math_parse.values(math_parse.parse("2^{10000}"), set()) is None          # exponent cap
    assert math_parse.values(math_parse.parse("10^{300}\\cdot 10^{300}"), set()) is None  # overflow, no huge int
    assert math_parse.constant_value(math_parse.parse("5!")) == 120


# ---- conventions -------------------------------------------------------------------------------

@pytest.mark.parametrize("pred, gold, expected", [
    ("\\{3, 1, 2\\}", "\\{1,2,3\\}", True), ("3, 1, 2", "1, 2, 3", True), ("x = 1, x = 2", "2, 1", True),
    ("1, 2", "1, 2, 3", False), ("1, 1, 2", "1, 2", False), ("(2, 1)", "(1, 2)", False), ("(1, 0.5)", "(1, \\frac12)", True),
    ("[1, 3)", "[1,3)", True), ("(1, 3]", "[1,3)", False), ("(-\\infty, 2]", "(-\\infty,2]", True),
    ("\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 & 2 \\\\ 4 & 3 \\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", False),
    ("-5, 5", "\\pm 5", True), ("\\{3\\}", "3", True), ("5", "-5, 5", False), ("42 \\text{ or } 43", "42", False),
    ("2\\frac{1}{2}", "\\frac{5}{2}", True), ("2 1/2", "2.5", True), ("0.\\overline{3}", "\\frac13", True),
    ("3.14159", "\\pi", True), ("3.14", "\\pi", False), ("0.333333", "\\frac13", True), ("0.333", "\\frac13", False),
    ("1000000.5", "1000000", False), ("50\\%", "50", True), ("50\\%", "0.5", False), ("\\text{(C)}", "C", True),
    ("\\text{Monday}", "monday", True), ("\\text{odd}", "\\text{even}", False), ("x = 5", "5", True),
    ("2x + y = 5", "y = 5 - 2x", True), ("y = 2x + 3", "y = 2x - 3", False), ("12 \\text{ cm}^2", "12", True),
    ("2 pi", "2", False), ("\\sqrt{16}", "4", True), ("2+2", "4", False), ("5x", "5", False),
])
def test_conventions(pred, gold, expected):
    assert answers_equal(pred, gold) is expected


def test_matrix_row_separator_survives_normalisation():
    """``\\\\ `` (row separator + space) used to lose a backslash, so a matrix did not match itself."""
    spaced = "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"
    assert normalize_answer(spaced) == "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"
    assert answers_equal(spaced, "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}")


# ---- extraction --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("#### **1200**", "1200"), ("#### 1200 (dollars)", "1200"), ("**#### 1200**", "1200"),
    ("#### The answer is 75", "75"), ("The answer is 50. Good luck with the other 3 problems!", "50"),
    ("So the probability is $\\frac{1}{2}$.", "\\frac{1}{2}"), ("We need $3 + 4 = 7$.", "7"),
    ("<think>so 72</think><answer>72</answer>", "72"), ("She pays $18 and gets $2 back, so $16.", "16"),
    ("so it is $2\\pi$", "2\\pi"), ("so it is 2\\pi", None), ("the side is $\\sqrt3$", "\\sqrt3"),
    ("It is either 42 or 43.", None), ("So \\boxed{42} or \\boxed{43}", None), ("So $r = 5$ or $r = 6$.", None),
    ("That's 10 more than last week.", None), ("The total is $\\$18$.", "\\$18"), ("the minimum is $-4$, attained at $x = 2$.", None),
])
def test_extraction(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("completion, gold, expected", [
    ("The circumference is $2\\pi$", "2", 0.0), ("The side is $\\sqrt3$", "3", 0.0), ("It is 43 or 42", "42", 0.0),
    ("#### **1200**", "1200", 1.0), ("#### 1200 (dollars)", "1200", 1.0), ("#### 12e2", "1200", 1.0),
    ("#### 1\\,000\\,000", "1000000", 1.0), ("#### 30°", "30", 1.0), ("#### - 5", "-5", 1.0),
])
def test_issue_examples(completion, gold, expected):
    assert acc(completion, gold) == expected


# ---- TRL's solution column ---------------------------------------------------------------------

def test_solution_column():
    completions = ["so $\\boxed{\\frac{1}{\\sqrt2}}$", "#### 72", "\\boxed{3}"]
    solutions = ["The value is $\\boxed{\\frac{\\sqrt{2}}{2}}$.", "She sold 72.\n#### 72", "\\frac{\\sqrt{2}}{2}"]
    assert math_accuracy_reward([None] * 3, completions, solution=solutions) == [1.0, 1.0, 0.0]
    reward = get_reward("math_accuracy")
    assert reward([None] * 3, completions, solution=solutions) == [1.0, 1.0, 0.0]
    assert reward([None] * 3, completions, answer=solutions, solution=["0"] * 3) == [1.0, 1.0, 0.0]
    with pytest.raises(TypeError, match="'answer' or 'solution'"):
        math_accuracy_reward([None], ["#### 1"])


# ---- the sympy worker --------------------------------------------------------------------------

def test_worker_tree_caps():
    for text in ("9^{9^{9}}", "10^{10^{10}}", "(2^{1000})^{1000}", "1000!", "2^{2^{2^{2^{2^{2}}}}}"):
        assert math_worker.to_sympy(text) is None, text
    assert math_worker.to_sympy("2^{1000}") is not None
    assert math_worker.sympy_equal("\\binom{5}{2}", "10") is True
    assert math_worker.sympy_equal("x \\ge 3", "x\\geq 3") is True
    assert math_worker.sympy_equal("x > 3", "x < 3") is False


def test_worker_hard_time_limit_kills_a_runaway_child():
    """A child stuck in work that never returns (here: a sleeping one) is SIGKILLed at the limit and the
    sample scores no verdict; the next request gets a fresh child."""
    hang = [sys.executable, "-c", "import sys, time; print('ready', flush=True); sys.stdin.readline(); time.sleep(600)"]
    worker = math_worker.SymbolicWorker(command=hang)
    try:
        t0 = time.perf_counter()
        assert worker.compare("\\binom{7}{2}", "21", timeout_s=0.3) is None
        assert time.perf_counter() - t0 < 1.5
        assert worker.restarts == 1 and worker._proc is None
    finally:
        worker.close()
    real = math_worker.SymbolicWorker()
    try:
        assert real.compare("\\binom{6}{2}", "15", timeout_s=30.0) is True     # started, warm
        proc = real._proc
        assert real.compare("\\binom{7}{2}", "21", timeout_s=0.0) is None      # no time left: killed
        assert proc.poll() is not None and real.restarts == 1
        assert real.compare("\\binom{7}{2}", "21", timeout_s=30.0) is True     # a fresh child serves it
    finally:
        real.close()


def test_forked_process_gets_its_own_worker():
    """A fork (e.g. a DataLoader worker) must not talk to the parent's child over the inherited pipes."""
    import os

    worker = math_worker.SymbolicWorker()
    try:
        assert worker.compare("\\binom{6}{2}", "15", timeout_s=30.0) is True
        parent_child = worker._proc.pid
        pid = os.fork()
        if pid == 0:  # the forked process: a fresh worker of its own, the parent's untouched
            ok = worker.compare("\\binom{7}{2}", "21", timeout_s=30.0) is True and worker._proc.pid != parent_child
            worker.close()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert worker._proc.pid == parent_child and worker._proc.poll() is None
        assert worker.compare("\\binom{8}{2}", "28", timeout_s=30.0) is True
    finally:
        worker.close()


def test_huge_values_are_not_equal_by_overflow():
    """binomial(10^7, 5*10^6) once overflowed to inf on both sides of a float comparison."""
    assert math_worker.to_sympy("\\binom{10^{7}}{5\\cdot 10^{6}}") is None
    assert math_worker.sympy_equal("\\binom{300}{150}", "\\binom{300}{149}") is False
    assert math_worker.sympy_equal("\\binom{300}{150}+1", "\\binom{300}{150}") is False  # exact, not 30 digits
    assert acc("\\boxed{\\binom{10^{7}}{5\\cdot 10^{6}}}", "\\binom{5}{2}") == 0.0


@pytest.mark.parametrize("gold", [
    "\\binom{9}{3} \\cdot 9^{9^{9}}", "1000! \\cdot x_1", "x_1^{10^{10^{10}}}", "\\binom{99}{50}^{999}",
    "|" + "(" * 50 + "x" + ")" * 50 + "|!",
])
def test_hostile_symbolic_answers_are_fast_and_score_zero(gold):
    math_accuracy_reward([None], ["\\boxed{\\binom{5}{2}}"], ["10"])  # the worker is started and warm
    t0 = time.perf_counter()
    out = math_accuracy_reward([None, None], [f"\\boxed{{{gold}}}", "\\boxed{\\binom{5}{2}}"], ["\\binom{5}{2}", gold])
    assert time.perf_counter() - t0 < 2.0  # two samples, each under its 1 s limit
    assert out == [0.0, 0.0]


def test_worker_child_cannot_evaluate_text():
    """In the child, eval and sympy's text parser raise; latex2sympy's numbers are built from digits."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('w', {str(Path(math_worker.__file__))!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._stub_packages()\n"
        "m.to_sympy('1'); m.forbid_text_evaluation()\n"
        "import sympy\n"
        "for f in (lambda: sympy.sympify('1+1'), lambda: eval('1+1')):\n"
        "    try:\n        f(); print('EVALUATED')\n    except RuntimeError:\n        print('blocked')\n"
        "print(m.sympy_equal('\\\\frac{1}{2}', '0.5'), m.sympy_equal('\\\\binom{5}{2}', '10'), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["blocked", "blocked", "True", "True", "False"], out.stderr[-2000:]


def test_safe_for_symbolic_gate():
    assert math_compare.safe_for_symbolic("\\binom{5}{2} + x_1")
    for text in ("__import__('os')", "\\input{/etc/passwd}", "x" * 1000, "a; b", "\"1\"", "x_" * 20 + "1",
                 "2^{" * 10 + "2" + "}" * 10, "x+" * 150 + "x"):
        assert not math_compare.safe_for_symbolic(text), text


HOSTILE_ANSWERS = {
    "dollar_pairs": "$1$" * 100_000, "latex_openers": "\\(" * 100_000, "answer_phrases": "the answer is " * 50_000,
    "or_chain": "1 or " * 100_000 + "2", "paren_note": "#### 5 (" + "a" * 5000, "units": "\\boxed{5" + " cm" * 300 + "}",
    "answer_tags": "<answer>1</answer>" * 30_000, "pow_chain": "\\boxed{" + "2^{" * 60 + "2" + "}" * 60 + "}",
    "sqrt_chain": "\\boxed{" + "\\sqrt{" * 150 + "2" + "}" * 150 + "}", "subscripts": "\\boxed{" + "x_" * 150 + "1}",
    "long_sum": "\\boxed{" + "x+" * 190 + "x}", "matrix": "\\boxed{\\begin{pmatrix}" + "1&" * 300 + "\\end{pmatrix}}",
    "overline": "\\boxed{0." + "1" * 100 + "\\overline{" + "3" * 100 + "}}", "factorials": "\\boxed{((3!)!)!}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_ANSWERS))
def test_hostile_answers_against_symbolic_golds(name):
    """New extraction paths and the symbolic gate stay fast on hostile text, as completion and as gold."""
    text = HOSTILE_ANSWERS[name]
    math_accuracy_reward([None], ["\\boxed{\\binom{5}{2}}"], ["10"])  # the worker is started and warm
    t0 = time.perf_counter()
    out = math_accuracy_reward([None] * 3, [text, text, "\\boxed{\\binom{5}{2}}"],
                               ["\\binom{5}{2}", "x_1 + \\binom{5}{2}", text])
    assert time.perf_counter() - t0 < 1.5, name
    assert out == [0.0, 0.0, 0.0]
