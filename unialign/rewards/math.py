"""Verifiable math rewards (GSM8K / MATH style): extract a final answer, compare it exactly with the reference.
Model output is never executed, eval'd or handed to sympy: a bounded hand-written grammar reads numbers.

Safety by design, then by budget: every input is length-capped before any regex runs, every regex is
free of nested quantifiers (linear time), numbers are exact ``Fraction``s with capped digits and exponent,
and each sample's extract+compare also runs under a wall-clock limit (``base.map_with_time_limit``);
an unparseable or timed-out answer scores 0.0.

Answer extraction, in order of preference (``extract_answer``):
    1. GSM8K: the text after the **last** ``####`` up to the end of its line (when not empty);
    2. the content of the **last** ``\\boxed{...}`` (balanced braces, nesting allowed);
    3. the last number in the text (integer, decimal, ``1,234``, ``3/4``, ``\\frac{3}{4}``, ``2e5``, signed;
       none when it is an exponent or subscript, as in ``10^5``).
    When a ``####`` line or the last ``\\boxed`` is present but malformed, there is no answer (score 0);
    the extractor never falls back to a number hidden inside a malformed answer (``#### 9**9`` is not 9).

Comparison (``answers_equal``): both sides are normalised (LaTeX wrappers ``\\text{}``, ``\\left``/``\\right``,
``$``, ``^\\circ``, ``\\%``, thin spaces, a trailing period, trailing unit words after a number,
a leading ``x =``). If either side reads as a number the two must be the same exact rational
(``0.75 == 3/4 == \\frac{3}{4}``, ``5.0 == 5``, ``−5 == -5``; ``0.333 != 1/3``, no tolerance); otherwise
the normalised strings must be identical. Percent signs are dropped, so ``50%`` equals ``50`` (GSM8K
writes percentages as bare numbers), not ``0.5``. Digits are ASCII ``0-9`` only; ``1,5`` (decimal
comma) is not a number. Like MATH's ``strip_string``, normalisation removes all whitespace, so
``1 000`` (and ``1\\,000``) read as 1000.
"""

from __future__ import annotations

import re
from collections import deque
from fractions import Fraction
from typing import Any

from unialign.rewards.base import completion_to_text, map_with_time_limit

MAX_NUMBER_CHARS = 200      # parse_number refuses longer strings outright
MAX_ANSWER_CHARS = 1000     # an extracted / reference answer longer than this is no answer
MAX_EXPONENT = 400          # |k| in 1e<k> or \times 10^{k}
LAST_NUMBER_WINDOW = 2000   # the last-number fallback looks at this many trailing characters

_MINUS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-", "\u2013": "-"})

# numbers: no nested quantifiers anywhere (linear-time matching)
_UNSIGNED = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
_NUMBER_TOKEN = re.compile(
    r"(?:(?<![0-9A-Za-z)\]}])[-+])?"
    r"(?:\\[dt]?frac\{[^{}]{1,50}\}\{[^{}]{1,50}\}|\\[dt]?frac[0-9]{2}(?![0-9])"
    rf"|(?:{_UNSIGNED})(?:[eE][-+]?[0-9]+)?(?:[ \t]*/[ \t]*(?:{_UNSIGNED}))?)"
)
_DECIMAL = re.compile(
    r"([-+]?)[ \t]*(?:([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.([0-9]*))?|\.([0-9]+))(?:[eE]([-+]?[0-9]+))?"
)
_TIMES_TEN = re.compile(r"([-+]?[ \t]*[0-9.,]+)[ \t]*(?:\\times|\\cdot|×|\*)[ \t]*10\^\{?([-+]?[0-9]+)\}?")
_LATEX_FRAC = re.compile(r"([-+]?)[ \t]*\\frac(?:\{([^{}]+)\}\{([^{}]+)\}|([0-9])([0-9]))")

_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)[ \t]*\{([^{}]*)\}")
_DROP = re.compile(r"\\left|\\right|\\[!,;: ]|\\\$|\$|\^\{?\\circ\}?|\\circ|°|\\%|%|\\\(|\\\)|\\\[|\\\]|\\displaystyle")
_UNITS = re.compile(r"([-+]?[0-9.][0-9.,/]*)[ \t]+[A-Za-z][A-Za-z \t./^]*")
_ASSIGNMENT = re.compile(r"[A-Za-z][ \t]*=[ \t]*(\S.*)")
_WHITESPACE = re.compile(r"\s+")
_BARE_TOKEN = re.compile(r"[^\s$]{1,200}")


def parse_number(s: str) -> Fraction | None:
    """The exact rational value of ``s``, or None when ``s`` is not a plain number.

    Accepts (with optional ``+``/``-``/``−`` sign, surrounding ``$``, outer braces, a trailing period or
    ``%``): integers, ``1,234`` (groups of three), decimals (``.5``, ``5.``), scientific ``2.5e-3``,
    ``1.5 \\times 10^{3}``, ``a/b`` and ``\\frac{a}{b}`` / ``\\dfrac`` / ``\\tfrac`` / ``\\frac34`` with
    decimal parts. Bounded: strings over ``MAX_NUMBER_CHARS`` and exponents over ``MAX_EXPONENT`` give None,
    so nothing can allocate a huge integer. Never evaluates anything: ``9**9`` and ``2+2`` give None.
    """
    if not isinstance(s, str) or len(s) > MAX_NUMBER_CHARS:
        return None
    s = s.translate(_MINUS).replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\$", "")
    s = s.strip().strip("$").strip()
    if s.endswith("\\%"):
        s = s[:-2]
    s = s.rstrip("%").rstrip()
    if len(s) > 1 and s.endswith("."):
        s = s[:-1]
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _balanced(s[1:-1]):
        s = s[1:-1].strip()
    if not s:
        return None
    value = _parse_decimal(s)
    if value is not None:
        return value
    m = _TIMES_TEN.fullmatch(s)
    if m:
        mantissa, exponent = _parse_decimal(m.group(1)), _bounded_exponent(m.group(2))
        return None if mantissa is None or exponent is None else mantissa * Fraction(10) ** exponent
    m = _LATEX_FRAC.fullmatch(s)
    if m:
        num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
        value = _ratio(_parse_decimal(num.strip()), _parse_decimal(den.strip()))
        return -value if value is not None and m.group(1) == "-" else value
    if s.count("/") == 1:
        num, den = s.split("/")
        return _ratio(_parse_decimal(num.strip()), _parse_decimal(den.strip()))
    return None


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += (c == "{") - (c == "}")
        if depth < 0:
            return False
    return depth == 0


def _bounded_exponent(text: str) -> int | None:
    digits = text.lstrip("+-")
    if len(digits) > 4:
        return None
    k = int(text)
    return k if abs(k) <= MAX_EXPONENT else None


def _parse_decimal(s: str) -> Fraction | None:
    m = _DECIMAL.fullmatch(s)
    if not m:
        return None
    sign, whole, frac, bare_frac, exponent = m.groups()
    if whole is None:
        whole, frac = "0", bare_frac
    frac = frac or ""
    value = Fraction(int(whole.replace(",", "") + frac), 10 ** len(frac))
    if exponent is not None:
        k = _bounded_exponent(exponent)
        if k is None:
            return None
        value *= Fraction(10) ** k
    return -value if sign == "-" else value


def _ratio(num: Fraction | None, den: Fraction | None) -> Fraction | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def normalize_answer(s: str) -> str | None:
    """A canonical string form of an answer for comparison, or None when ``s`` is empty or longer than
    ``MAX_ANSWER_CHARS``: drops ``\\text{}``-style wrappers (keeping their content), ``\\left``/``\\right``,
    ``$``, degree and percent signs, LaTeX spacing, a leading ``x =``, unit words after a number, all
    whitespace and a trailing period; ``\\dfrac``/``\\tfrac`` become ``\\frac``. Linear time."""
    if not isinstance(s, str) or len(s) > MAX_ANSWER_CHARS:
        return None
    s = s.translate(_MINUS).replace("{,}", ",")
    for _ in range(3):  # \text{\textbf{a}}: innermost first
        s = _WRAPPER.sub(r"\1", s)
    s = _DROP.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").strip()
    m = _ASSIGNMENT.fullmatch(s)
    if m:
        s = m.group(1).strip()
    m = _UNITS.fullmatch(s)
    if m:
        s = m.group(1)
    s = _WHITESPACE.sub("", s)
    if len(s) > 1 and s.endswith("."):
        s = s[:-1]
    return s or None


def answers_equal(prediction: str, reference: str) -> bool:
    """True when two extracted answers agree: equal exact rationals if either side is a number, else
    identical ``normalize_answer`` strings (see the module docstring). Never evaluates either side."""
    p, r = normalize_answer(prediction), normalize_answer(reference)
    if p is None or r is None:
        return False
    p_value, r_value = parse_number(p), parse_number(r)
    if p_value is not None or r_value is not None:
        return p_value is not None and p_value == r_value
    return p == r


def extract_answer(text: str, *, last_number: bool = True) -> str | None:
    """The final answer in a model's ``text`` (stripped), or None: the last ``####`` line, else the
    last ``\\boxed{...}``, else (when ``last_number``) the last number. A present but malformed ``####``
    answer or last ``\\boxed`` (unbalanced, or longer than ``MAX_ANSWER_CHARS``) gives None rather than a
    fallback. Linear time in ``len(text)``; see the module docstring for the grammar."""
    if not isinstance(text, str):
        return None
    hashes = text.rfind("####")
    if hashes >= 0:
        line = _line_after(text, hashes + 4)
        if line is None:
            return None
        if line.strip():
            return line.strip()
    boxed = text.rfind("\\boxed")
    if boxed >= 0:
        return _boxed_content(text, boxed + len("\\boxed"))
    return _last_number(text) if last_number else None


def reference_answer(reference: Any) -> str | None:
    """The answer inside a dataset reference: after the last ``####`` (a full GSM8K solution), else the
    last ``\\boxed{}`` (a MATH solution), else the whole value as a string (a bare answer such as ``"72"``
    or ``72``). None when empty or malformed."""
    if reference is None:
        return None
    text = reference if isinstance(reference, str) else str(reference)
    if "####" in text or "\\boxed" in text:
        return extract_answer(text, last_number=False)
    return text.strip() or None


def _line_after(text: str, start: int) -> str | None:
    """``text[start:]`` up to the next newline; None when that is longer than ``MAX_ANSWER_CHARS``."""
    end = text.find("\n", start, start + MAX_ANSWER_CHARS + 1)
    if end < 0:
        end = len(text)
    return text[start:end] if end - start <= MAX_ANSWER_CHARS else None


def _boxed_content(text: str, i: int) -> str | None:
    """Content of ``\\boxed{...}`` whose ``{`` is at or after ``i`` (balanced braces), or ``\\boxed 5``."""
    stop = min(len(text), i + MAX_ANSWER_CHARS + 2)
    while i < stop and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        m = _BARE_TOKEN.match(text, i)
        return m.group(0) if m else None
    depth = 0
    for j in range(i, stop):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                content = text[i + 1 : j].strip()
                return content or None
    return None  # unbalanced, or longer than MAX_ANSWER_CHARS


def _last_number(text: str) -> str | None:
    """The last number token in the final ``LAST_NUMBER_WINDOW`` characters; None if there is none, if
    it runs past the window start (a number that long is no answer) or if it is an exponent or subscript
    (``10^5``, ``x_2``: an expression, which is never evaluated)."""
    start = max(0, len(text) - LAST_NUMBER_WINDOW)
    window = text[start:].translate(_MINUS)  # one-to-one characters: offsets unchanged
    tail = deque(_NUMBER_TOKEN.finditer(window), maxlen=1)
    if not tail:
        return None
    last = tail[0]
    if last.start() == 0 and start > 0 and text[start - 1] in "0123456789.,/{}\\":
        return None
    if window[max(0, last.start() - 2) : last.start()].endswith(("^", "_", "^{", "_{")):  # x^2, a_{3}
        return None
    return last.group(0).strip()


def _score(item: tuple[str, Any, bool]) -> float:
    text, reference, last_number = item
    prediction = extract_answer(text, last_number=last_number)
    ref = reference_answer(reference)
    if prediction is None or ref is None:
        return 0.0
    return 1.0 if answers_equal(prediction, ref) else 0.0


def math_accuracy_reward(prompts: list[Any], completions: list[Any], answer: list[Any], *,
                         timeout_s: float = 1.0, last_number: bool = True, **kwargs: Any) -> list[float]:
    """1.0 where a completion's final answer equals the reference, else 0.0 (TRL reward signature).

    ``completions``: strings or conversational message lists (the last assistant message is read).
    ``answer``: per-sample references, a full GSM8K solution ending ``#### N``, a MATH solution with
    ``\\boxed{}``, or a bare value. ``timeout_s``: wall-clock budget per sample (overrun scores 0.0).
    ``last_number=False`` accepts only ``####`` / ``\\boxed`` answers (no bare-number fallback).
    Extra dataset columns in ``kwargs`` are ignored. Never raises on hostile text; raises ValueError
    if ``answer`` and ``completions`` differ in length.
    """
    if len(answer) != len(completions):
        raise ValueError(f"{len(answer)} answers for {len(completions)} completions")
    texts = [completion_to_text(c) for c in completions]
    items = [(t, a, last_number) for t, a in zip(texts, answer)]
    return [float(x) for x in map_with_time_limit(_score, items, timeout_s, 0.0)]


def math_format_reward(prompts: list[Any], completions: list[Any], *, style: str = "gsm8k",
                       **kwargs: Any) -> list[float]:
    """1.0 where a completion has the required final-answer format, else 0.0 (TRL reward signature).

    ``style="gsm8k"``: the last non-empty line is ``#### <value>`` (``####``, at least one space or tab,
    then a value ``parse_number`` accepts — ``72``, ``1,000``, ``$5``, ``-3/4``, ``2.5`` — and nothing
    else; leading whitespace on the line is allowed).
    ``style="think_answer"``: the whole completion (surrounding whitespace aside) is
    ``<think>...</think>`` then optional whitespace then ``<answer>...</answer>`` with a non-empty answer,
    each tag appearing exactly once. Correctness is not checked here (see ``math_accuracy_reward``).
    Linear time; extra dataset columns in ``kwargs`` are ignored.
    """
    if style not in ("gsm8k", "think_answer"):
        raise ValueError(f"style must be 'gsm8k' or 'think_answer', got {style!r}")
    check = _has_gsm8k_final_line if style == "gsm8k" else _has_think_answer_format
    return [1.0 if check(completion_to_text(c)) else 0.0 for c in completions]


def _has_gsm8k_final_line(text: str) -> bool:
    text = text.rstrip()
    line = text[text.rfind("\n") + 1 :].strip()
    if len(line) > MAX_ANSWER_CHARS or not line.startswith("####") or line[4:5] not in (" ", "\t"):
        return False
    return parse_number(line[4:].strip()) is not None


def _has_think_answer_format(text: str) -> bool:
    text = text.strip()
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(text.count(tag) != 1 for tag in tags):
        return False
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return False
    think_end, answer_start = text.find("</think>"), text.find("<answer>")
    if not think_end < answer_start or text[think_end + len("</think>") : answer_start].strip():
        return False
    return bool(text[answer_start + len("<answer>") : -len("</answer>")].strip())
