"""Verifiable math rewards (GSM8K / MATH style): extract a final answer, compare it with the reference.
Model output is never executed, eval'd or handed to ``sympify`` / ``parse_expr``.

Three tiers, cheapest first (``math_accuracy_reward``):

1. **In-process, exact** (``math_compare``): answers are cleaned (LaTeX presentation, units, ``x =``),
   numbers compared as exact rationals, structures (sets, tuples, intervals, matrices, lists) split and
   compared element by element, text answers case-insensitively. Every input is length-capped before any
   regex runs and every regex is linear-time; runs under ``base.map_with_time_limit``.
2. **In-process, numeric** (``math_parse``): expressions in a small LaTeX grammar (``\\frac``, ``\\sqrt``,
   ``\\pi``, powers, trig / log, implicit products, mixed numbers) are parsed by recursive descent into a
   capped tree and evaluated in complex floating point at three fixed points of their letters (one
   negative); equal when all agree to a relative 1e-13, a near tie (1e-13..1e-9) goes to tier 3. Floats cannot grow into huge integers, so this tier is bounded.
3. **Worker process, symbolic** (``math_worker``): what tiers 1-2 cannot decide, when both sides pass a
   whitelist of math characters and LaTeX commands, goes to a persistent child process that parses with
   ``latex2sympy2_extended`` (ANTLR grammar), checks the tree (size, depth, exponent, factorial caps) and
   compares with sympy; a request over ``timeout_s`` gets the child killed (a fresh one serves the next).

Answer extraction, in order of preference (``extract_answer``):
    1. GSM8K: the text after the **last** ``####`` up to the end of its line (when not empty), without
       markdown emphasis (``#### **1200**``), a parenthesised word note (``#### 1200 (dollars)``) or a
       leading "The answer is";
    2. the content of the **last** ``\\boxed{...}`` (balanced braces, nesting allowed); none when it is
       ``\\boxed{a} or \\boxed{b}`` (a hedge);
    3. the content of the last ``<answer>...</answer>`` (itself read by these rules);
    4. (``last_number`` only) the rest of the sentence after the last "answer is" / "answer:" phrase, so
       text after the answer never supplies it;
    5. (``last_number`` only) the last number in plain text: numbers inside LaTeX math (``$...$`` with
       LaTeX in it, ``\\(...\\)``, ``\\[...\\]``, ``$$...$$``), next to a LaTeX command (``2\\pi``,
       ``\\sqrt3``), a variable (``2x``), an exponent or subscript (``10^5``) do not count, and a hedged
       last number ("42 or 43") gives no answer.
    When a ``####`` line or the last ``\\boxed`` is present but malformed, there is no answer (score 0);
    the extractor never falls back to a number hidden inside a malformed answer (``#### 9**9`` is not 9).

Comparison conventions (``answers_equal``; details in ``math_compare``): a number gold needs a plain
number with the same exact value (``0.75 == 3/4``, ``2\\frac{1}{2} == 5/2``, ``1\\,000 == 1000``;
``2+2 != 4``); tolerance only for a decimal of >= 6 significant digits against a gold value with no
finite decimal expansion (within one unit of its last place: ``3.14159 == \\pi``, ``0.333 != 1/3``); percent signs are dropped
(``50\\% == 50 != 0.5``); sets and bare lists are order-free, tuples and intervals ordered with matching
brackets, matrices cell by cell; a single-value gold never matches several values; ``x = 5 == 5``;
``\\text{Monday} == monday``; a gold word is text (``\\text{on} != no``, ``CA != AC``); ``y = 5 != x = 5``.
A last-number fallback in a negated or uncertain sentence ("It is not 42.", "Maybe 42?") gives no answer.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from unialign.rewards import math_worker
from unialign.rewards.base import completion_to_text, map_with_time_limit
from unialign.rewards.math_compare import (  # noqa: F401 - re-exported (public API of this module)
    MAX_ANSWER_CHARS,
    MAX_EXPONENT,
    MAX_NUMBER_CHARS,
    clean,
    compare,
    normalize_answer,
    number_value,
    parse_number,
)

LAST_NUMBER_WINDOW = 2000   # the last-number and answer-phrase fallbacks look at this many trailing characters

_MINUS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-", "\u2013": "-"})

# numbers: no nested quantifiers anywhere (linear-time matching)
_UNSIGNED = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
_NUMBER_TOKEN = re.compile(
    r"(?:(?<![0-9A-Za-z)\]}])[-+])?"
    r"(?:\\[dt]?frac\{[^{}]{1,50}\}\{[^{}]{1,50}\}|\\[dt]?frac[0-9]{2}(?![0-9])"
    rf"|(?:{_UNSIGNED})(?:[eE][-+]?[0-9]+)?(?:[ \t]*/[ \t]*(?:{_UNSIGNED}))?)"
)
_BARE_TOKEN = re.compile(r"[^\s$]{1,200}")
_MATH_REGION = re.compile(r"\$\$[^$]{0,2000}\$\$|\\\((?:[^\\]|\\[^)]){0,2000}\\\)|\\\[(?:[^\\]|\\[^\]]){0,2000}\\\]"
                          r"|\$(?:[^$\\\n]|\\[^\n]){1,300}\$")  # \$ inside $...$ is an escaped dollar
_LATEX_IN_DOLLARS = re.compile(r"[\\^_{}]|[0-9][A-Za-z]|[A-Za-z][0-9]|^[^0-9]*$")
_HEDGE_BEFORE = re.compile(r"(?i)(?:\bor|\band/or|[0-9][ \t]*/)(?:[ \t]+(?:maybe|possibly|perhaps|else))?[ \t,]*$")
_COMPARATIVE_AFTER = re.compile(r"(?i)[ \t]*(?:[A-Za-z]+[ \t]+)?(?:more|less|fewer|greater|smaller)[ \t]+than\b")
_PHRASE = re.compile(r"(?i)\banswer(?:[ \t]+is|[ \t]*:|[ \t]+is[ \t]*:)[ \t*:]*")
_PHRASE_PREFIX = re.compile(r"(?i)^(?:the[ \t]+)?(?:final[ \t]+)?answer(?:[ \t]+is|[ \t]*:)[ \t*:]*")
_SENTENCE_END = re.compile(r"\.(?:[ \t]|$)|\n|!|\?")
_EMPHASIS = re.compile(r"^[*_ \t]+|[*_ \t]+$")
_WORD_NOTE = re.compile(r"(.*?\S)[ \t]*\((?=[0-9 ]{0,10}[A-Za-z])[A-Za-z0-9][A-Za-z0-9 .,'-]{0,60}\)[ \t.]*")
_COUNTED = re.compile(r"([-+]?[0-9][0-9.,]*)[ \t]+[A-Za-z]+(?:[ \t]+[A-Za-z]+)?[ \t]+and[ \t]+[0-9][^\n]*")
_TAIL_AFTER_MATH = re.compile(r"[ \t]*(?:is|are|units?|square units|cm|m|degrees)?[ \t.,;:!)]*(?:\n|$)")
_UNSURE = re.compile(r"(?i)\b(?:maybe|perhaps|possibly|probably|unsure|not[ \t]+sure|guess|cannot|can't|can[ \t]+not"
                     r"|unclear|uncertain|don't[ \t]+know)\b")
_NEGATED = re.compile(r"(?i)\b(?:not|never|isn't|wasn't|aren't|no[ \t]+longer)(?:[ \t]+[A-Za-z$]+){0,2}[ \t$]*$")
_BOXED_OR = re.compile(r"(?i)^[ \t$.,]*(?:\\text\{)?[ \t]*or\b")


def answers_equal(prediction: str, reference: str, *, timeout_s: float = 1.0) -> bool:
    """True when two extracted answers agree under the module's conventions (tiers 1-3 above; the
    symbolic tier under a hard ``timeout_s``). Never evaluates either side."""
    verdict = compare(prediction, reference)
    if verdict is None:
        verdict = math_worker.shared_worker().compare(prediction, reference, timeout_s)
    return bool(verdict)


def extract_answer(text: str, *, last_number: bool = True) -> str | None:
    """The final answer in a model's ``text`` (stripped), or None: the last ``####`` line, else the
    last ``\\boxed{...}``, else the last ``<answer>`` tag, else (when ``last_number``) the sentence after
    the last "answer is" phrase or the last plain-text number. A present but malformed ``####`` answer or
    last ``\\boxed`` (unbalanced, or longer than ``MAX_ANSWER_CHARS``) gives None rather than a fallback.
    Linear time in ``len(text)``; see the module docstring for the rules."""
    if not isinstance(text, str):
        return None
    hashes = text.rfind("####")
    if hashes >= 0:
        line = _line_after(text, hashes + 4)
        if line is None:
            return None
        line = _tidy(line)
        if line:
            return line
    boxed = text.rfind("\\boxed")
    if boxed >= 0:
        return _last_boxed(text, boxed)
    tag = text.rfind("<answer>")
    if tag >= 0:
        end = text.find("</answer>", tag, tag + MAX_ANSWER_CHARS + 10)
        if end >= 0:
            inner = text[tag + len("<answer>") : end]
            found = extract_answer(inner, last_number=False) or _tidy(inner)
            if found and len(found) <= 200:
                return found
    if not last_number:
        return None
    phrase = _after_phrase(text)
    if phrase is not None:
        return phrase
    return _last_math(text) or _last_number(text)


def _tidy(line: str) -> str:
    """A ``####`` / tag answer without markdown emphasis, an "answer is" prefix or a parenthesised note."""
    line = _EMPHASIS.sub("", line.strip())
    line = _PHRASE_PREFIX.sub("", line)
    line = _EMPHASIS.sub("", line)
    m = _WORD_NOTE.fullmatch(line)
    if m:
        line = m.group(1)
    return line.strip()


def _last_boxed(text: str, boxed: int) -> str | None:
    """Content of the last ``\\boxed``; None when it is malformed or hedged (``\\boxed{a} or \\boxed{b}``)."""
    content = _boxed_content(text, boxed + len("\\boxed"))
    previous = text.rfind("\\boxed", max(0, boxed - 300), boxed)
    if content is not None and previous >= 0:
        earlier = _boxed_content(text, previous + len("\\boxed"))
        if earlier is not None and earlier != content:
            closing = text.find(earlier, previous) + len(earlier) + 1
            if 0 < closing <= boxed and _BOXED_OR.match(text[closing:boxed]):
                return None
    return content


def reference_answer(reference: Any) -> str | None:
    """The answer inside a dataset reference: after the last ``####`` (a full GSM8K solution), else the
    last ``\\boxed{}`` (a MATH solution), else the whole value as a string (a bare answer such as ``"72"``,
    ``72`` or ``\\frac{\\sqrt{2}}{2}``). None when empty or malformed."""
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


def _after_phrase(text: str) -> str | None:
    """The rest of the sentence after the last "answer is" / "answer:" in the trailing window, or None."""
    window = text[-LAST_NUMBER_WINDOW:]
    last = deque(_PHRASE.finditer(window), maxlen=1)
    if not last:
        return None
    rest = window[last[0].end() :]
    if rest.startswith(("$", "\\(", "\\[")):
        region = _MATH_REGION.match(rest)
        if region:
            return _tidy(region.group(0)) or None
    end = _SENTENCE_END.search(rest)
    value = _tidy(rest[: end.start()] if end else rest)
    counted = _COUNTED.fullmatch(value)
    if counted:  # "12 apples and 3 pears": the first count is the answer
        value = counted.group(1)
    return value if value and len(value) <= 200 else None


def _last_number(text: str) -> str | None:
    """The last number token of the plain text in the final ``LAST_NUMBER_WINDOW`` characters; None if
    there is none, if it runs past the window start, if it is an exponent or subscript (``10^5``), sits next
    to LaTeX or a variable (``2\\pi``, ``\\sqrt3``, ``2x``), is hedged ("42 or 43"), negated ("It is not
    42.") or in a sentence with an uncertainty word ("Maybe 42?", "I cannot tell; 42")."""
    start = max(0, len(text) - LAST_NUMBER_WINDOW)
    window = text[start:].translate(_MINUS)  # one-to-one characters: offsets unchanged
    window = _MATH_REGION.sub(_blank_latex, window)
    tail = deque(_NUMBER_TOKEN.finditer(window), maxlen=1)
    if not tail:
        return None
    last = tail[0]
    if last.start() == 0 and start > 0 and text[start - 1] in "0123456789.,/{}\\":
        return None
    before, after = window[max(0, last.start() - 40) : last.start()], window[last.end() : last.end() + 3]
    if before.endswith(("^", "_", "^{", "_{", "\\sqrt", "\\sqrt{")):  # x^2, a_{3}, \sqrt3
        return None
    if after[:1] in ("\\", "^", "!", "_") or re.match(r"[A-Za-z](?![A-Za-z])", after):  # 2\pi, 3^2, 2x
        return None
    if _HEDGE_BEFORE.search(before):  # "43 or 42"
        return None
    if _COMPARATIVE_AFTER.match(window, last.end()):  # "That's 10 more than last week": not an answer
        return None
    sentence = window[max(window.rfind(m, 0, last.start()) for m in (". ", "\n", "? ", "! ")) + 1 : last.end()]
    if _UNSURE.search(sentence) or _NEGATED.search(before):  # "Maybe 42?", "It is not 42.": no answer
        return None
    return last.group(0).strip()


def _last_math(text: str) -> str | None:
    """The content of the last LaTeX math region (``$...$``, ``\\(...\\)``, ``\\[...\\]``, ``$$...$$``)
    when nothing but punctuation and short words follow it in its sentence and no plain-text number comes
    after it: ``So the probability is $\\frac{1}{2}$.`` gives ``\\frac{1}{2}``. In ``$a = b$`` the part after
    the last ``=`` is the answer. None when hedged (``$5$ or $6$``) or when an earlier region of the same
    sentence holds a number too (``the minimum is $-4$, attained at $x = 2$``: which one is the answer?)."""
    window = text[-LAST_NUMBER_WINDOW:]
    last = deque((m for m in _MATH_REGION.finditer(window) if _blank_latex(m) != m.group(0)), maxlen=1)
    if not last:
        return None
    region = last[0]
    after = window[region.end() :]
    if _NUMBER_TOKEN.search(after) or not _TAIL_AFTER_MATH.match(after):
        return None
    if _HEDGE_BEFORE.search(window[max(0, region.start() - 40) : region.start()]):
        return None
    sentence = max(window.rfind(". ", 0, region.start()), window.rfind("\n", 0, region.start()), 0)
    if any(re.search(r"[0-9]", m.group(0)) for m in _MATH_REGION.finditer(window, sentence, region.start())):
        return None  # "the minimum is $-4$, attained at $x = 2$": two values in the last sentence
    content = region.group(0).strip("$")
    for opener, closer in (("\\(", "\\)"), ("\\[", "\\]")):
        if content.startswith(opener) and content.endswith(closer):
            content = content[2:-2]
    content = content.strip()
    if "=" in content:
        content = content[content.rfind("=") + 1 :].strip()
    return content or None


def _blank_latex(m: re.Match) -> str:
    """A LaTeX math region becomes spaces (same length); a ``$...$`` pair that is currency (no LaTeX in it
    and a digit right after the closing ``$``, as in ``$18 and $20``) stays."""
    region = m.group(0)
    if (region.startswith("$") and not region.startswith("$$") and not _LATEX_IN_DOLLARS.search(region[1:-1])
            and m.string[m.end() : m.end() + 1].isdigit()):  # "$18 and $20": the closing $ is the next amount's
        return region
    return " " * len(region)


def _score(item: tuple[str, Any, bool]) -> float | tuple[str, str]:
    """1.0 / 0.0, or ``(prediction, reference)`` when only the symbolic worker can decide."""
    text, reference, last_number = item
    prediction = extract_answer(text, last_number=last_number)
    ref = reference_answer(reference)
    if prediction is None or ref is None:
        return 0.0
    verdict = compare(prediction, ref)
    if verdict is None:
        return (prediction, ref)
    return 1.0 if verdict else 0.0


def math_accuracy_reward(prompts: list[Any], completions: list[Any], answer: list[Any] | None = None, *,
                         solution: list[Any] | None = None, timeout_s: float = 1.0, last_number: bool = True,
                         **kwargs: Any) -> list[float]:
    """1.0 where a completion's final answer equals the reference, else 0.0 (TRL reward signature).

    ``completions``: strings or conversational message lists (the last assistant message is read).
    ``answer`` or (TRL's name) ``solution``: per-sample references, a full GSM8K solution ending
    ``#### N``, a MATH solution with ``\\boxed{}``, or a bare value / LaTeX answer (``answer`` wins when
    both are given). ``timeout_s``: wall-clock budget per sample for the in-process tiers and, separately,
    the hard limit of a sample's symbolic check in the worker process (overrun scores 0.0).
    ``last_number=False`` accepts only ``####`` / ``\\boxed`` / ``<answer>`` answers (no fallbacks).
    Extra dataset columns in ``kwargs`` are ignored. Never raises on hostile text; raises TypeError
    without a reference column and ValueError if the references and ``completions`` differ in length.
    """
    references = answer if answer is not None else solution
    if references is None:
        raise TypeError("math_accuracy needs the reference answers in an 'answer' or 'solution' column")
    if len(references) != len(completions):
        raise ValueError(f"{len(references)} answers for {len(completions)} completions")
    texts = [completion_to_text(c) for c in completions]
    items = [(t, a, last_number) for t, a in zip(texts, references)]
    results = map_with_time_limit(_score, items, timeout_s, 0.0)
    out = []
    for r in results:
        if isinstance(r, tuple):
            r = 1.0 if math_worker.shared_worker().compare(r[0], r[1], timeout_s) else 0.0
        out.append(float(r))
    return out


math_accuracy_reward.needs_one_of = ("answer", "solution")  # checked against the dataset before any model loads


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
