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
       text after the answer never supplies it; a ``$...$`` region there is the answer (none when "or"
       follows it: ``$5$ or $6$``; ``$x = 1$, $y = 2$`` is the list ``x = 1, y = 2``);
    5. (``last_number`` only) the last LaTeX region ending the text (``$x = 1, y = 2$`` stays a list; two
       regions ``$x = 1$ and $y = 2$`` of the last sentence join into one), then the last number in plain
       text: numbers inside LaTeX math (``$...$`` with LaTeX in it, ``\\(...\\)``, ``\\[...\\]``, ``$$...$$``),
       next to a LaTeX command (``2\\pi``, ``\\sqrt3``), a variable (``2x``), an exponent, superscript or
       subscript (``10^5``, ``2³``) do not count, and a hedged last number ("42 or 43") gives no answer.
       Number words are never read here, and a number word after the last number ("He had 5 apples and
       ate two.") means no answer. A plain-text run ``x = 1 and y = 2`` ending the sentence is the list
       ``x = 1, y = 2`` (several values; ``x = 1 or x = 2`` is a hedge). A digit-grouped ``1 000 000`` is one
       number (``1 000`` with a single plain space is ambiguous: no answer).
       **Truncation**: when the text stops mid-sentence (its last character, trailing ``**`` / ``</think>``
       aside, is not ``. ! ? ) ] } " ' %`` and the number is not the last token), the number must lie in that
       unfinished last sentence and be followed only by up to 8 words, none a continuation word ("and",
       "then", "so", "which", "plus", ...) and the last not a dangling one ("the", "of", "to", "in", "he",
       "gives", ...): "He has 8. Then he gives away" and "he has 8 and then he" give no answer, "so he
       covers 180 miles" and "3/4 of the cake left" keep theirs.
    An equation chain of numbers gives its last side (``#### 6*7=42``, "The answer is 1 + 41 = 42.",
    ``\\boxed{6 \\times 7 = 42}`` -> ``42``; ``42 = 6*7`` -> ``42``; ``x = 6*7 = 42`` -> ``x = 42``); ``x = 5``,
    ``2x = 10`` and gold answers are left as they are.
    When a ``####`` line or the last ``\\boxed`` is present but malformed, there is no answer (score 0);
    the extractor never falls back to a number hidden inside a malformed answer (``#### 9**9`` is not 9).

Comparison conventions (``answers_equal``; details in ``math_compare``): a number gold needs a plain
number with the same exact value (``0.75 == 3/4``, ``2\\frac{1}{2} == 5/2``, ``(-5) == -5``; thousands groups
``1\\,000\\,000 == 1{,}000{,}000 == 10^6 == 1 million == 1000000``; words in an answer slot: ``forty-two``,
``negative 5``, ``#### twelve apples``; ``#### 2+2 != 4``), but the content of ``\\boxed{}`` (and a ``$...$``
right after "the answer is") is LaTeX math, compared by value: ``\\boxed{40+2} == 42`` (not with a ``%``
in it); tolerance only for a decimal of >= 6 significant digits against a gold value with no
finite decimal expansion (within one unit of its last place: ``3.14159 == \\pi``, ``0.333 != 1/3``); percent signs are dropped
(``50\\% == 50 != 0.5``); sets and bare lists are order-free, tuples and intervals ordered with matching
brackets, unions of intervals / sets a set of pieces
(``(1,\\infty)\\cup(-\\infty,0) == (-\\infty,0)\\cup(1,\\infty)``), matrices cell by cell; assignments to distinct letters are put in the letters' order (``y = 2, x = 1 ==
(1, 2) != (2, 1)``); a single-value gold never matches several values; ``x = 5 == 5``;
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
    word_number,
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
_OR_AFTER = re.compile(r"(?i)[ \t$.,]*(?:\\text\{)?[ \t]*or\b")
# an equation chain's earlier sides: numbers and arithmetic only (6*7=42, 1 + 41 = 42, 6 \times 7 = 42)
_CHAIN_COMMANDS = re.compile(r"\\(?:times|cdot|div|[dt]?frac|left|right|[,!;: ]|\$)")
_CHAIN_SIDE = re.compile(r"[0-9 \t.,+\-*/×÷()\[\]{}$^]*")
_CHAIN_VARIABLE = re.compile(r"[ \t$]*([A-Za-z])[ \t$]*")
# plain-text final sentence "x = 1, y = 2" / "x = 1 and y = 2": several values
_ASSIGN_NUM = re.compile(r"(?<![A-Za-z0-9_\\])([A-Za-z])[ \t]*=[ \t]*"
                         r"([-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:[ \t]*/[ \t]*[0-9]+)?)"
                         r"(?![0-9.]?[0-9A-Za-z])")
_ASSIGN_SEP = re.compile(r"(?i)[ \t]*(?:,|;|and|,[ \t]*and|\\text\{[ \t]*and[ \t]*\})[ \t]*")
_ASSIGN_OR = re.compile(r"(?i)[ \t]*,?[ \t]*(?:or|\\text\{[ \t]*or[ \t]*\})[ \t]*")
# the last-number fallback: what stops it
_SUPERSCRIPT = "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b"
_NUMBER_WORD_AFTER = re.compile(
    r"(?i)\b(?:zero|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen"
    r"|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|thousand|million"
    r"|billion|dozen|half|twice|double|doubled|triple|tripled|thrice)\b")
_SPACE_GROUPED = re.compile(r"(?<![0-9.,])[0-9]{1,3}(?:[ \u2009\u202f\u00a0][0-9]{3})+$")
_CLOSING_TAG = re.compile(r"</?[A-Za-z]{1,20}>$")
_FINISHED = frozenset(".!?)]}\"'\u2019\u201d%\u00b0")
_TAIL_WORDS = re.compile(r"[A-Za-z'-]+(?:[ \t]+[A-Za-z'-]+){0,7}")
_CONTINUATION_WORDS = frozenset(
    "and or but then so because which that plus minus times divided multiplied than if when while after before "
    "until since giving leaving making".split())
_DANGLING_WORDS = frozenset(
    "the a an of to for from with by per in on at into is are was were be has have had his her their its he she "
    "they we it i you this these gives give gets get buys buy".split())


def answers_equal(prediction: str, reference: str, *, timeout_s: float = 1.0, by_value: bool = False) -> bool:
    """True when two extracted answers agree under the module's conventions (tiers 1-3 above; the
    symbolic tier under a hard ``timeout_s``). ``by_value``: the prediction is LaTeX math (a ``\\boxed{}``
    content), so ``40+2`` equals 42. Never evaluates either side."""
    verdict = compare(prediction, reference, by_value=by_value)
    if verdict is None:
        verdict = math_worker.shared_worker().compare(prediction, reference, timeout_s, by_value=by_value)
    return bool(verdict)


def extract_answer(text: str, *, last_number: bool = True) -> str | None:
    """The final answer in a model's ``text`` (stripped), or None: the last ``####`` line, else the
    last ``\\boxed{...}``, else the last ``<answer>`` tag, else (when ``last_number``) the sentence after
    the last "answer is" phrase or the last plain-text number. An equation chain of numbers gives its last
    side (``6*7=42`` -> ``42``). A present but malformed ``####`` answer or last ``\\boxed`` (unbalanced, or
    longer than ``MAX_ANSWER_CHARS``) gives None rather than a fallback.
    Linear time in ``len(text)``; see the module docstring for the rules."""
    return _extract(text, last_number)[0]


def _extract(text: str, last_number: bool = True, prediction: bool = True) -> tuple[str | None, bool]:
    """``(answer, latex)``: the answer as ``extract_answer`` reads it and whether it is marked LaTeX math (the
    content of a ``\\boxed{}``, or the ``$...$`` region right after "the answer is": compared by value, so
    ``\\boxed{40+2}`` is 42). ``prediction=False`` (a gold answer) leaves an equation chain as it is."""
    if not isinstance(text, str):
        return None, False
    answer, latex = _find(text, last_number)
    if answer is not None and prediction:
        answer = _chain_tail(answer)
    return answer, latex


def _find(text: str, last_number: bool) -> tuple[str | None, bool]:
    hashes = text.rfind("####")
    if hashes >= 0:
        line = _line_after(text, hashes + 4)
        if line is None:
            return None, False
        line = _tidy(line)
        if line:
            return line, False
    boxed = text.rfind("\\boxed")
    if boxed >= 0:
        return _last_boxed(text, boxed), True
    tag = text.rfind("<answer>")
    if tag >= 0:
        end = text.find("</answer>", tag, tag + MAX_ANSWER_CHARS + 10)
        if end >= 0:
            inner = text[tag + len("<answer>") : end]
            found, latex = _find(inner, last_number=False)
            if not found:
                found, latex = _tidy(inner), False
            if found and len(found) <= 200:
                return found, latex
    if not last_number:
        return None, False
    phrase = _after_phrase(text)
    if phrase == "":
        return None, False  # a hedged answer phrase: no fallback to an earlier number
    if phrase is not None:
        return phrase, phrase.startswith(("$", "\\(", "\\["))
    math = _last_math(text)
    if math is not None:
        return math, False  # a trailing region is no marked answer: "So we compute $40+2$." is not 42
    return _last_number(text), False


def _chain_tail(answer: str) -> str:
    """The value of an equation chain of numbers: the last side, when every earlier side is arithmetic on
    numbers (``6*7=42``, ``1 + 41 = 42``, ``6 \\times 7 = 42``, ``100 - 58 = 42 dollars`` -> ``42``;
    ``x = 6 \\cdot 7 = 42`` -> ``x = 42``); when the last side is not a plain number but an earlier one is
    and every side is arithmetic (``42 = 6*7``), the last plain number. Anything else (``x = 5``,
    ``2x = 10``, ``f(2) = 5``) is returned unchanged."""
    if "=" not in answer or answer.count("=") > 8:
        return answer
    sides = answer.split("=")
    variable = _CHAIN_VARIABLE.fullmatch(sides[0]) if len(sides) >= 3 else None
    values = sides[1:] if variable else sides
    if not values[0].strip() and len(values) >= 2:
        values = values[1:]  # "= 42"
    if len(values) < 2 or not all(re.search(r"[0-9]", v) for v in values):
        return answer
    if not all(_CHAIN_SIDE.fullmatch(_CHAIN_COMMANDS.sub(" ", v)) for v in values[:-1]):
        return answer
    last = values[-1].strip()
    if not _CHAIN_SIDE.fullmatch(_CHAIN_COMMANDS.sub(" ", last)) or parse_number(last) is None:
        plain = [v.strip() for v in values if parse_number(v.strip()) is not None]
        if _CHAIN_SIDE.fullmatch(_CHAIN_COMMANDS.sub(" ", last)) and plain:
            last = plain[-1]  # 42 = 6*7
    return f"{variable.group(1)} = {last}" if variable else last


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
        return _extract(text, last_number=False, prediction=False)[0]
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
    """The rest of the sentence after the last "answer is" / "answer:" in the trailing window, or None;
    ``""`` when it is a hedged LaTeX answer (``$5$ or $6$``)."""
    window = text[-LAST_NUMBER_WINDOW:]
    last = deque(_PHRASE.finditer(window), maxlen=1)
    if not last:
        return None
    rest = window[last[0].end() :]
    if rest.startswith(("$", "\\(", "\\[")):
        region = _MATH_REGION.match(rest)
        if region:
            regions = [region]
            for more in _MATH_REGION.finditer(rest, region.end(), region.end() + 400):
                if not _ASSIGN_SEP.fullmatch(rest[regions[-1].end() : more.start()]):
                    break
                regions.append(more)
            if len(regions) >= 2:  # "The answer is $x = 1$, $y = 2$."
                joined = _joined_assignments(rest, regions)
                if joined:
                    return joined
            if _OR_AFTER.match(rest, region.end()):  # "The answer is $5$ or $6$.": a hedge, no answer at all
                return ""
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
    if after[:1] in ("\\", "^", "!", "_", *_SUPERSCRIPT) or re.match(r"[A-Za-z](?![A-Za-z])", after):
        return None  # 2\pi, 3^2, 10⁶, 2x
    if _HEDGE_BEFORE.search(before):  # "43 or 42"
        return None
    if _COMPARATIVE_AFTER.match(window, last.end()):  # "That's 10 more than last week": not an answer
        return None
    if _NUMBER_WORD_AFTER.search(window, last.end()):  # "She had 5 apples and ate two.": 5 is not the last number
        return None
    sentence_start = max(window.rfind(m, 0, last.start()) for m in (". ", "\n", "? ", "! ")) + 1
    sentence = window[sentence_start : last.end()]
    if _UNSURE.search(sentence) or _NEGATED.search(before):  # "Maybe 42?", "It is not 42.": no answer
        return None
    if not _finished_at(window, last):  # "... so he has 8. Then he gives away": cut off mid-sentence
        return None
    value = last.group(0).strip()
    if re.fullmatch(r"[0-9]{3}", value) and re.search(r"[0-9][ \u2009\u202f\u00a0]$", before):
        # digit groups: "1 000 000" and "1\u2009000" are one number; "2 100" is ambiguous; "000" alone never
        grouped = _SPACE_GROUPED.search(window, max(sentence_start, last.start() - 60), last.end())
        if grouped and (grouped.group(0).count(" ") >= 2 or " " not in grouped.group(0)):
            return grouped.group(0)
        return None
    run = _assignments_before(window, sentence_start, last)
    if run == "":
        return None  # "x = 1 or x = 2": a hedge
    return run or value


def _finished_at(window: str, last: re.Match) -> bool:
    """Whether the last-number fallback may read ``last``: the text ends a sentence (``.``, ``!``, ``?``, a
    closing bracket or quote, ``%``; trailing markup such as ``**`` or ``</think>`` aside), or the number is
    its last token, or the number is in the unfinished last sentence and only a few words that end
    nothing follow it (``so he covers 180 miles``, ``3/4 of the cake left``; not ``8 and then he``,
    ``8 apples to``, ``8,``)."""
    end = _strip_markup(window[last.end() :])
    body = window[: last.end()] + end
    if not end or body[-1] in _FINISHED:
        return True
    fragment = max(body.rfind(m) for m in (". ", "! ", "? ", "\n")) + 1
    if last.start() < fragment:
        return False  # the unfinished sentence holds no number; the last one belongs to an earlier sentence
    tail = end.strip()
    if not _TAIL_WORDS.fullmatch(tail):
        return False
    words = tail.lower().split()
    return not (set(words) & _CONTINUATION_WORDS) and words[-1] not in _DANGLING_WORDS


def _strip_markup(s: str) -> str:
    """``s`` without trailing whitespace, markdown marks (``*``, ``_``, `````, ``#``) and closing tags
    (``</think>``). Linear time."""
    for _ in range(20):
        s = s.rstrip(" \t\r\n*_`#")
        tag = _CLOSING_TAG.search(s, max(0, len(s) - 23))
        if not tag:
            break
        s = s[: tag.start()]
    return s


def _assignments_before(window: str, sentence_start: int, last: re.Match) -> str | None:
    """``Thus x = 1 and y = 2.``: when the last number ends a run of at least two ``letter = number``
    assignments joined by ``,`` / ``and``, the run as a list (``x = 1, y = 2``: several values). None when there
    is no such run, ``""`` when the last two are joined by "or" (a hedge)."""
    found = [m for m in _ASSIGN_NUM.finditer(window, sentence_start, last.end())]
    if len(found) < 2 or found[-1].end() != last.end():
        return None
    run = [found[-1]]
    for m in reversed(found[:-1]):
        gap = window[m.end() : run[0].start()]
        if _ASSIGN_OR.fullmatch(gap):
            return ""  # "x = 1 or x = 2": hedged
        if not _ASSIGN_SEP.fullmatch(gap):
            break
        run.insert(0, m)
    if len(run) < 2:
        return None
    return ", ".join(f"{m.group(1)} = {m.group(2)}" for m in run)


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
    earlier = [m for m in _MATH_REGION.finditer(window, sentence, region.start())
               if re.search(r"[0-9]", m.group(0))]
    if earlier:  # "the minimum is $-4$, attained at $x = 2$": two values in the last sentence
        return _joined_assignments(window, earlier + [region])  # unless "$x = 1$ and $y = 2$"
    content = _region_content(region.group(0))
    if "=" in content and not _assignment_list(content):  # "$x = 1, y = 2$" stays a list
        content = content[content.rfind("=") + 1 :].strip()
    return content or None


def _region_content(region: str) -> str:
    content = region.strip("$")
    for opener, closer in (("\\(", "\\)"), ("\\[", "\\]")):
        if content.startswith(opener) and content.endswith(closer):
            content = content[2:-2]
    return content.strip()


def _assignment_list(content: str) -> list[str] | None:
    """The items of ``x = 1, y = 2`` / ``x = 1 \\text{ and } y = 2`` (at least two ``letter = value``), or
    None."""
    items = [p.strip() for p in re.split(r",|;|\\text\{[ \t]*and[ \t]*\}|\band\b", content)]
    if len(items) >= 2 and all(re.fullmatch(r"[A-Za-z][ \t]*=[ \t]*[^=]+", p) for p in items):
        return items
    return None


def _joined_assignments(window: str, regions: list[re.Match]) -> str | None:
    """``So $x = 1$ and $y = 2$.``: the regions of the last sentence, when every one is a single assignment
    to its own letter and only ``,`` / ``and`` separate them, as one list ``x = 1, y = 2``; else None."""
    items = [_region_content(m.group(0)) for m in regions]
    if not all(re.fullmatch(r"[A-Za-z][ \t]*=[ \t]*[^=,;]+", item) for item in items):
        return None
    if len({item[0] for item in items}) != len(items):
        return None
    gaps = [window[a.end() : b.start()] for a, b in zip(regions, regions[1:])]
    if not all(_ASSIGN_SEP.fullmatch(gap) for gap in gaps):
        return None
    return ", ".join(items)


def _blank_latex(m: re.Match) -> str:
    """A LaTeX math region becomes spaces (same length); a ``$...$`` pair that is currency (no LaTeX in it
    and a digit right after the closing ``$``, as in ``$18 and $20``) stays."""
    region = m.group(0)
    if (region.startswith("$") and not region.startswith("$$") and not _LATEX_IN_DOLLARS.search(region[1:-1])
            and m.string[m.end() : m.end() + 1].isdigit()):  # "$18 and $20": the closing $ is the next amount's
        return region
    return " " * len(region)


def _score(item: tuple[str, Any, bool]) -> float | tuple[str, str, bool]:
    """1.0 / 0.0, or ``(prediction, reference, by_value)`` when only the symbolic worker can decide."""
    text, reference, last_number = item
    prediction, latex = _extract(text, last_number=last_number)
    ref = reference_answer(reference)
    if prediction is None or ref is None:
        return 0.0
    verdict = compare(prediction, ref, by_value=latex)
    if verdict is None:
        return (prediction, ref, latex)
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
            r = 1.0 if math_worker.shared_worker().compare(r[0], r[1], timeout_s, by_value=r[2]) else 0.0
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
