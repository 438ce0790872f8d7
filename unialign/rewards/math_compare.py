"""Comparison of two extracted math answers (a prediction and a gold answer), without executing either.

This module imports neither torch nor sympy, so the symbolic worker process (``math_worker``) can use the
same rules. ``compare(prediction, gold, symbolic=None)`` gives True / False, or None when only a symbolic
check (sympy, in the killable worker) can decide.

Conventions (see ``unialign/rewards/math.py`` for the whole list):

* **Numbers are exact.** When the gold is a plain number (integer, decimal, ``1,234``, ``a/b``,
  ``\\frac{a}{b}``, a mixed number ``2\\frac{1}{2}`` / ``2 1/2``, ``2.5e3``, ``1.5 \\times 10^{3}``), the
  prediction must be a plain number with the same exact rational value: ``0.75 == \\frac34``,
  ``5.0 == 5``, ``(-5) == -5``; arithmetic left in a plain answer (``2+2``) does not count, a LaTeX expression
  (``\\sqrt{16}``, ``10^6``) and anything with ``by_value`` (the content of ``\\boxed{}``: ``40+2``) is compared
  by value. Thousands groups are one number (``join_thousands``: ``1\\,000\\,000``, ``1{,}000{,}000``,
  ``10,\\!000``, ``1 000 000``); two numbers side by side are never a product (``1\\,000`` is not 1*000 = 0).
  A prediction in words is read by ``word_number`` (``forty-two``, ``negative 5``, ``1.5 million``; scale
  words are never dropped as units: ``5 million != 5``); a gold word stays text.
  *Tolerance*: a decimal with at least ``TOL_MIN_DIGITS`` (6) significant digits matches a gold value that
  has no finite decimal expansion (``1/3``, ``\\sqrt2/2``, ``\\pi``) when within one unit of its last decimal
  place (so rounded or truncated both count): ``0.333333 == 1/3``, ``3.14159 == \\pi``, ``0.707107 ==
  \\frac{\\sqrt2}{2}``, but ``0.333 != 1/3`` and ``3.1416 != \\pi`` (too few digits).
  Expressions are equal when their values agree to a relative 1e-13 at three fixed points of their free
  letters, one negative (``math_parse.same_value``: ``|x| != x``); a near tie (within 1e-9, not 1e-13) and
  anything else undecided goes to sympy in the worker (50 digits, relative 1e-30: ``\\pi + 10^{-10} != \\pi``).
* **Percent** signs are dropped: ``50\\% == 50`` (GSM8K writes percentages as bare numbers), ``!= 0.5``.
* **Structures**: a gold set ``\\{...\\}`` or bare list ``a, b`` is order-free (a multiset); a gold tuple
  or interval ``(a, b]`` is ordered and its brackets must match; a union ``A \\cup B`` is a multiset of its
  pieces, each compared as above (any order, brackets kept); a list of assignments to distinct letters is
  sorted by letter (``y = 2, x = 1`` is ``(1, 2)``); matrices (``pmatrix`` / ``bmatrix`` /
  ``vmatrix`` / ``array``) compare cell by cell. A single-value gold never matches a prediction with
  several values (a hedge such as ``42 \\text{ or } 43``).
* ``x = 5`` equals ``5`` (a leading single-letter or tuple-of-letters assignment, or ``x \\in``, is dropped),
  but ``y = 5 != x = 5`` (both name a variable and they differ); ``\\varnothing == \\emptyset``;
  equations compare as ``lhs - rhs`` up to sign; text answers (``\\text{Monday}``, ``(A)``) compare
  case-insensitively with ``\\text{}`` wrappers, surrounding parentheses and whitespace removed; a gold
  word (``\\text{no}``, ``AC``, ``ab``; not ``xy``, see ``_is_word_answer``) is text, never a product of letters.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

from unialign.rewards import math_parse

MAX_NUMBER_CHARS = 200      # parse_number refuses longer strings outright
MAX_ANSWER_CHARS = 1000     # an extracted / reference answer longer than this is no answer
MAX_EXPONENT = 400          # |k| in 1e<k> or \times 10^{k}
MAX_ELEMENTS = 32           # elements of a set / tuple / matrix
TOL_MIN_DIGITS = 6          # significant digits a decimal needs to match a value with no finite decimal expansion

_MINUS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-", "\u2013": "-"})
_SUPERSCRIPT_RUN = re.compile(r"[\u2070\u00b9\u00b2\u00b3\u2074-\u2079\u207a\u207b]+")  # 10⁶, m², 10⁻³
_SUPERSCRIPT_DIGITS = str.maketrans("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b",
                                    "0123456789+-")
# thousands groups inside LaTeX or typeset text: 1\,000\,000, 1{,}000{,}000, 10,\!000, 1 000 000, 1~000 (a plain
# comma group, 1,000,000, is a number already); the first group has 1-3 digits, every later one exactly 3
_GROUP_SEP = r"(?:(?:\\!)?(?:,\\!|\{,\})|\\[,!; ]|[ ~\u2009\u202f\u00a0])"
_THOUSANDS = re.compile(rf"(?<![0-9.,^_])(?<!\^\{{)(?<!_\{{)([0-9]{{1,3}})((?:{_GROUP_SEP}[0-9]{{3}})+)(?![0-9/])")
_SPACED_DIGITS = re.compile(r"[0-9.][ \t]+[-+]?[0-9.]")  # two numbers side by side: whitespace never joins them
_PAREN_NUMBER = re.compile(r"\([ \t]*([^()]{1,60}?)[ \t]*\)")  # (-5)

_DECIMAL = re.compile(
    r"([-+]?)[ \t]*(?:([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.([0-9]*))?|\.([0-9]+))(?:[eE]([-+]?[0-9]+))?"
)
_TIMES_TEN = re.compile(r"([-+]?[ \t]*[0-9.,]+)[ \t]*(?:\\times|\\cdot|×|\*|x)[ \t]*10\^\{?([-+]?[0-9]+)\}?")
_LATEX_FRAC = re.compile(r"([-+]?)[ \t]*\\frac(?:\{([^{}]+)\}\{([^{}]+)\}|([0-9])([0-9]))")
_MIXED = re.compile(r"([-+]?)[ \t]*([0-9]+)[ \t]*(?:\\frac\{[ \t]*([0-9]+)[ \t]*\}\{[ \t]*([0-9]+)[ \t]*\}"
                    r"|\\frac([0-9])([0-9])|[ \t]([0-9]+)[ \t]*/[ \t]*([0-9]+))")

_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname|boxed)[ \t]*\{([^{}]*)\}")
_DROP = re.compile(r"\\\\|\\left|\\right|\\[!,;: ]|\\\$|\$|\^\{?\\circ\}?|\\circ|°|\\%|%|\\\(|\\\)|\\\[|\\\]"
                   r"|\\displaystyle|~")
_UNITS = re.compile(r"([-+]?[0-9.][0-9.,/]*)[ \t]+[A-Za-z][A-Za-z \t./^]*(?:\^\{?[23]\}?)?")
_TRAILING_UNIT = re.compile(r"(.*?\S)((?:[ \t]+[A-Za-z]{2,}\.?){1,3})(?:\^\{?[23]\}?)?[ \t]*")
_SCALE_WORDS = frozenset("hundred hundreds thousand thousands million millions billion billions trillion "
                         "trillions dozen dozens".split())
_MATH_WORDS = (frozenset("pi sqrt mod ln log sin cos tan or and not is are plus minus divided multiplied".split())
               | _SCALE_WORDS)  # never dropped as units: "5 million" is not 5, "8 minus" is no answer
_REPEATING = re.compile(r"([-+]?)([0-9]*)\.([0-9]{0,20})\\overline\{([0-9]{1,20})\}")
_PM = "\\pm"
_ASSIGNMENT = re.compile(r"(?:[A-Za-z]|\([ \t]*[A-Za-z](?:[ \t]*,[ \t]*[A-Za-z])+[ \t]*\))[ \t]*=[ \t]*(\S.*)")
_SINGLE_ASSIGNMENT = re.compile(r"([A-Za-z])[ \t]*=[ \t]*([^=\s][^=]*)")
_MEMBERSHIP = re.compile(r"[A-Za-z][ \t]*\\in[ \t]*(\S.*)")  # x \in (1, 2)
_ASSIGNMENT_LHS = re.compile(r"([A-Za-z]|\([ \t]*[A-Za-z](?:[ \t]*,[ \t]*[A-Za-z])+[ \t]*\))[ \t]*=[ \t]*\S")
_WORD = re.compile(r"[A-Za-z]{2,}(?: [A-Za-z]+){0,5}")
_TEXT_WRAPPED = re.compile(r"\\(?:text|textbf|textit|textrm|mbox)[ \t]*\{[^{}]*\}")
_FUNCTION_WORDS = frozenset(
    "pi sqrt mod ln log exp sin cos tan sec csc cot arcsin arccos arctan sinh cosh tanh lg deg inf".split())
_WHITESPACE = re.compile(r"\s+")
_MATRIX = re.compile(r"\\begin\{([pbvBV]?matrix|array)\}(?:\{[lcr|]*\})?(.*)\\end\{\1\}")
_TEXTLIKE = re.compile(r"[A-Za-z][A-Za-z .,'()-]*")
_OPTION = re.compile(r"\(?([A-Za-z])\)?")
_OR_WORDS = re.compile(r"[ \t]+(?:or|and)[ \t]+")
_COMMAND = re.compile(r"\\[A-Za-z]+")
SAFE_COMMANDS = frozenset(
    "frac dfrac tfrac sqrt pi cdot times div sin cos tan sec csc cot arcsin arccos arctan sinh cosh tanh "
    "ln log exp infty infinity binom dbinom tbinom le leq ge geq lt gt ne neq cup cap emptyset varnothing "
    "alpha beta gamma delta theta lambda mu sigma phi omega pm mp circ deg".split())
_SYMPY_ONLY = re.compile(r"\\(?:[dt]?binom|le|leq|ge|geq|ne|neq|lt|gt|cup|cap|pm|mp|emptyset|varnothing|circ|deg"
                         r"|infty)(?![A-Za-z])|[_!|<>]")
_SAFE_CHARS = re.compile(r"[A-Za-z0-9 +\-*/^_(){}\[\]|!,.=<>\\]*")


# ----------------------------------------------------------------------------------------- numbers
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
    s = _superscripts(s.translate(_MINUS))
    s = s.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\$", "")
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


def number_value(s: str) -> Fraction | None:
    """``parse_number``, plus mixed numbers: ``2\\frac{1}{2}``, ``2\\frac12`` and ``2 1/2`` are 5/2 (the
    fraction proper: numerator < denominator; the sign applies to the whole), and a plain number in
    parentheses: ``(-5)`` is -5."""
    value = parse_number(s)
    if value is not None or not isinstance(s, str) or len(s) > MAX_NUMBER_CHARS:
        return value
    m = _PAREN_NUMBER.fullmatch(s.strip())
    if m:
        return parse_number(m.group(1))
    m = _REPEATING.fullmatch(s.strip())
    if m:  # 0.1\overline{6} = 1/6
        sign, whole, fixed, rep = m.groups()
        value = int(whole or "0") + Fraction(int(fixed or "0"), 10 ** len(fixed))
        value += Fraction(int(rep), 10 ** len(fixed) * (10 ** len(rep) - 1))
        return -value if sign == "-" else value
    m = _MIXED.fullmatch(s.translate(_MINUS).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").strip())
    if not m:
        return None
    sign, whole = m.group(1), int(m.group(2))
    num, den = next((m.group(k), m.group(k + 1)) for k in (3, 5, 7) if m.group(k) is not None)
    num, den = int(num), int(den)
    if not 0 < num < den:
        return None
    value = whole + Fraction(num, den)
    return -value if sign == "-" else value


def _superscripts(s: str) -> str:
    """Unicode superscripts as a LaTeX power: ``10⁶`` -> ``10^{6}``, ``m²`` -> ``m^{2}``."""
    return _SUPERSCRIPT_RUN.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPT_DIGITS) + "}", s)


def join_thousands(s: str) -> str:
    """Digit groups of a number typeset with thin spaces or LaTeX separators become one number:
    ``1\\,000\\,000``, ``1{,}000{,}000``, ``10,\\!000``, ``1 000 000`` -> ``1000000`` (the first group 1-3
    digits, each later group exactly 3; ``2 1/2`` and ``12 34`` are left alone). Linear time."""
    return _THOUSANDS.sub(lambda m: m.group(1) + re.sub(r"[^0-9]", "", m.group(2)), s)


_SMALL_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS_WORDS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}
_SCALES = {"thousand": 10 ** 3, "million": 10 ** 6, "billion": 10 ** 9, "trillion": 10 ** 12}
_FRACTION_WORDS = {"half": 2, "halves": 2, "third": 3, "thirds": 3, "quarter": 4, "quarters": 4, "fourth": 4,
                   "fourths": 4, "fifth": 5, "fifths": 5, "sixth": 6, "sixths": 6, "seventh": 7, "sevenths": 7,
                   "eighth": 8, "eighths": 8, "ninth": 9, "ninths": 9, "tenth": 10, "tenths": 10}
NUMBER_WORDS = (frozenset(_SMALL_WORDS) | frozenset(_TENS_WORDS) | frozenset(_SCALES) | frozenset(_FRACTION_WORDS)
                | {"hundred", "dozen"})
_MULTIPLIERS = frozenset(_SCALES) | {"hundred", "dozen"}
_NOT_UNIT_WORDS = frozenset(
    "or and more less fewer than times plus minus over of per by to from not a an the".split())
_SPOKEN = re.compile(r"[a-z0-9 .'-]*")
_SPOKEN_TOKEN = re.compile(r"[a-z']+|[0-9]+(?:\.[0-9]+)?")
MAX_WORD_NUMBER_CHARS = 120
MAX_UNIT_WORDS = 2


def word_number(s: str) -> Fraction | None:
    """The value of a number written in English words (the whole of ``s``, case-insensitive), else None:
    ``forty-two``, ``one hundred and five``, ``twelve hundred``, ``two thousand three hundred``, ``a dozen``,
    ``three quarters``, ``one half``, ``one and a half``, ``1.5 million``, ``5 thousand``, ``negative 5`` /
    ``minus five``, with at most ``MAX_UNIT_WORDS`` unit words after it (``twelve apples``). The grammar is
    strict: ``two five``, ``forty twelve``, ``twelve or thirteen``, ``forty, two`` and ``one of them`` are not
    numbers, nor are plain digits (``parse_number``'s). Read on the prediction side only: a gold word such
    as ``\\text{five}`` stays text."""
    if not isinstance(s, str) or len(s) > MAX_WORD_NUMBER_CHARS:
        return None
    s = s.lower().replace("\u2010", "-").replace("\u2011", "-").strip()
    if len(s) > 1 and s.endswith("."):
        s = s[:-1].rstrip()
    if not _SPOKEN.fullmatch(s):
        return None
    sign = 1
    if s.startswith("-"):
        sign, s = -1, s[1:].lstrip()
    if re.search(r"(?<![a-z])-|-(?![a-z])", s):
        return None  # a hyphen only joins two words (forty-two)
    tokens = s.replace("-", " ").split()
    if not tokens or any(not _SPOKEN_TOKEN.fullmatch(t) for t in tokens):
        return None
    if tokens[0] in ("negative", "minus"):
        if sign == -1:
            return None
        sign, tokens = -1, tokens[1:]
    units = 0
    while len(tokens) > 1 and tokens[-1].isalpha() and tokens[-1] not in NUMBER_WORDS:
        if tokens[-1] in _NOT_UNIT_WORDS or units == MAX_UNIT_WORDS:
            return None
        tokens, units = tokens[:-1], units + 1  # twelve apples, forty-two square feet
    if not tokens:
        return None
    if not any(t in NUMBER_WORDS for t in tokens):
        if sign == -1 and len(tokens) == 1 and tokens[0][0].isdigit():
            return -Fraction(tokens[0])  # negative 5
        return None
    value = _spoken_value(tokens)
    return None if value is None else sign * value


def _spoken_value(tokens: list[str]) -> Fraction | None:
    """A whole token list as a number (see ``word_number``)."""
    if len(tokens) > 16:
        return None
    last = tokens[-1]
    if last not in _FRACTION_WORDS:
        return _integer_words(tokens)
    if last == "half" and len(tokens) >= 3 and tokens[-3:-1] == ["and", "a"]:  # one and a half
        whole = _integer_words(tokens[:-3])
        return None if whole is None else whole + Fraction(1, 2)
    head, plural = tokens[:-1], last.endswith("s")
    if not head:
        num = 1 if last == "half" else None
    elif head in (["a"], ["an"], ["one"]):
        num = 1
    else:
        num = _integer_words(head)
    if num is None or num == 0 or num.denominator != 1 or (num == 1) == plural:
        return None  # "two third", "one thirds", "1.5 halves"
    return Fraction(num, _FRACTION_WORDS[last])


def _integer_words(tokens: list[str]) -> Fraction | None:
    """``forty two``, ``one hundred and five``, ``2 thousand``, ``a dozen``: scales in decreasing order."""
    total, i, last_scale, n = Fraction(0), 0, None, len(tokens)
    while i < n:
        seg, i = _below_thousand(tokens, i, first=(i == 0))
        if seg is None:
            return None
        if i < n and tokens[i] == "dozen":
            seg, i = seg * 12, i + 1
        if i < n and tokens[i] in _SCALES:
            scale = _SCALES[tokens[i]]
            if last_scale is not None and scale >= last_scale:
                return None
            total, last_scale, i = total + seg * scale, scale, i + 1
            if i < n and tokens[i] == "and":
                i += 1
                if i == n:
                    return None
            continue
        if i != n:
            return None
        return total + seg
    return total if last_scale is not None else None


def _below_thousand(tokens: list[str], i: int, first: bool) -> tuple[Fraction | None, int]:
    """A value below 1000 from ``tokens[i:]``: ``three hundred and twelve``, ``forty two``, ``twelve hundred``;
    ``a`` or digits (the first token only: ``1.5 million``) before a scale, ``hundred`` or ``dozen``."""
    n, t = len(tokens), tokens[i]
    if t[0].isdigit() or t in ("a", "an"):
        if (t[0].isdigit() and not first) or i + 1 >= n or tokens[i + 1] not in _MULTIPLIERS:
            return None, i
        value, i = (Fraction(t) if t[0].isdigit() else Fraction(1)), i + 1
    else:
        value, i = _tens_words(tokens, i)
        if value is None:
            return None, i
    if i < n and tokens[i] == "hundred":
        if value == 0 or value >= 100:
            return None, i
        value, i = value * 100, i + 1
        joined = i < n and tokens[i] == "and"
        if joined:
            i += 1
        if i < n and (tokens[i] in _SMALL_WORDS or tokens[i] in _TENS_WORDS):
            rest, i = _tens_words(tokens, i)
            if rest is None or rest == 0:
                return None, i
            value += rest
        elif joined:
            return None, i
    return value, i


def _tens_words(tokens: list[str], i: int) -> tuple[Fraction | None, int]:
    """``forty``, ``forty two``, ``twelve``, ``zero`` (only alone)."""
    t = tokens[i]
    if t in _TENS_WORDS:
        value, i = _TENS_WORDS[t], i + 1
        if i < len(tokens) and tokens[i] in _SMALL_WORDS and 0 < _SMALL_WORDS[tokens[i]] < 10:
            value, i = value + _SMALL_WORDS[tokens[i]], i + 1
        return Fraction(value), i
    if t in _SMALL_WORDS and (t != "zero" or len(tokens) == 1):
        return Fraction(_SMALL_WORDS[t]), i + 1
    return None, i


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


def _significant_digits(s: str) -> int:
    digits = re.sub(r"[eE].*", "", s).replace(",", "")
    if "." not in digits:
        return 0  # an integer is exact, never "rounded"
    return len(digits.replace(".", "").replace("-", "").replace("+", "").lstrip("0"))


def _last_place(s: str) -> Fraction:
    """One unit in the last decimal place of a plain decimal (``3.14159`` -> 1e-5; exponent aware)."""
    s = s.strip().rstrip(".")
    mantissa, _, exponent = re.sub(r"\\times10\^\{?", "e", s.replace(" ", "")).rstrip("}").partition("e")
    decimals = len(mantissa.partition(".")[2])
    k = _bounded_exponent(exponent) if exponent else 0
    return Fraction(1, 10 ** decimals) * Fraction(10) ** (k or 0)


def _terminates(value: Fraction) -> bool:
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


# ----------------------------------------------------------------------------------------- cleaning
def clean(s: str, *, keep_assignment: bool = False) -> str | None:
    """``s`` without LaTeX presentation: ``\\text{}``-style wrappers (content kept), ``\\left``/``\\right``,
    ``$``, degree and percent signs, LaTeX spacing, ``\\dfrac``/``\\tfrac`` (-> ``\\frac``), a leading
    ``x =`` / ``(x, y) =``, unit words after a number, a trailing period; whitespace collapsed to single
    spaces (kept, so ``\\pi r`` stays two tokens). None when empty or over ``MAX_ANSWER_CHARS``."""
    if not isinstance(s, str) or len(s) > MAX_ANSWER_CHARS:
        return None
    s = join_thousands(_superscripts(s.translate(_MINUS))).replace("{,}", ",")
    for _ in range(3):  # \text{\textbf{a}}: innermost first
        s = _WRAPPER.sub(r" \1 ", s)
    s = _DROP.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else " ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _WHITESPACE.sub(" ", s).strip()
    if len(s) > 1 and s.endswith("."):
        s = s[:-1].rstrip()
    s = s.replace("\\varnothing", "\\emptyset")
    s = _sorted_assignments(s)
    m = _ASSIGNMENT.fullmatch(s) or _MEMBERSHIP.fullmatch(s)
    if m and not keep_assignment:
        s = m.group(1).strip()
    m = _UNITS.fullmatch(s)
    if m and not set(s[m.end(1) :].lower().replace(".", " ").replace("^", " ").split()) & _MATH_WORDS:
        s = m.group(1)
    else:
        m = _TRAILING_UNIT.fullmatch(s)
        if (m and re.search(r"[0-9\\]", m.group(1)) and m.group(1)[-1] not in "+-*/=^_{(,"
                and not set(m.group(2).lower().replace(".", " ").split()) & _MATH_WORDS):
            s = m.group(1).strip()
    if len(s) > 1 and s.endswith("."):
        s = s[:-1].rstrip()
    return s or None


def _sorted_assignments(s: str) -> str:
    """``y = 2, x = 1`` -> ``x = 1, y = 2``: a list of assignments to distinct single letters is put in
    alphabetical order of the letters (the order of a coordinate tuple), so it compares with ``(1, 2)``."""
    if s.count("=") < 2:
        return s
    parts = _split_top(s, (",", ";", " and "))
    items = [_SINGLE_ASSIGNMENT.fullmatch(p) for p in parts]
    if len(items) < 2 or not all(items) or len({m.group(1) for m in items}) != len(items):
        return s
    return ", ".join(m.group(0) for m in sorted(items, key=lambda m: m.group(1)))


def normalize_answer(s: str) -> str | None:
    """A canonical string form of an answer for comparison, or None when ``s`` is empty or longer than
    ``MAX_ANSWER_CHARS``: ``clean`` with all whitespace removed. Linear time."""
    s = clean(s)
    if s is None:
        return None
    s = _WHITESPACE.sub("", s)
    return s or None


# ----------------------------------------------------------------------------------------- structure
def _split_top(s: str, seps: tuple[str, ...]) -> list[str]:
    """``s`` split at separators outside (), [], {} (bounded by ``MAX_ELEMENTS`` pieces)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            for sep in seps:
                if s.startswith(sep, i):
                    parts.append(s[start:i])
                    i += len(sep)
                    start = i
                    break
            else:
                i += 1
                continue
            if len(parts) > MAX_ELEMENTS:
                return []
            continue
        i += 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def structure(s: str) -> tuple[str, object]:
    """``(kind, parts)`` of a cleaned answer: ``("matrix", rows)``, ``("set", elements)``,
    ``("seq", (open, close, elements))`` for a bracketed tuple / interval, ``("list", elements)`` for a bare
    list separated by commas, ``\\text{ or }``/``and`` or ``;``, else ``("scalar", s)``."""
    m = _MATRIX.fullmatch(s.strip())
    if m:
        rows = [r for r in (row.strip() for row in m.group(2).split("\\\\")) if r]
        return "matrix", [[c.strip() for c in row.split("&")] for row in rows]
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set", [e for e in _split_top(s[2:-2], (",", ";")) if e]
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _brackets_close_at_end(s):
        inner = _split_top(s[1:-1], (","))
        if len(inner) >= 2:
            return "seq", (s[0], s[-1], inner)
    parts = _split_top(s, (",", ";", " or ", " and "))
    if len(parts) >= 2:
        if number_value(s) is not None:  # 1,000 is a number
            return "scalar", s
        return "list", [_ASSIGNMENT.fullmatch(p).group(1) if _ASSIGNMENT.fullmatch(p) else p for p in parts]
    return "scalar", s


def _brackets_close_at_end(s: str) -> bool:
    """The opening bracket at 0 closes at the last character (not ``(1,2)\\cup(3,4)``)."""
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0 and i != len(s) - 1:
                return False
    return depth == 0


# ----------------------------------------------------------------------------------------- comparison
Symbolic = Callable[[str, str], "bool | None"]


def compare(prediction: str, gold: str, symbolic: Symbolic | None = None, *,
            by_value: bool = False) -> bool | None:
    """True / False; None when only ``symbolic`` (not given here) could decide. Never evaluates text.

    ``by_value``: the prediction is LaTeX math (the content of ``\\boxed{}`` or of a ``$...$`` region), so
    arithmetic in it is compared by value against a number gold (``40+2 == 42``); without it (a ``####``
    line, plain text) a number gold needs a plain number (``2+2 != 4``). A percent sign turns it off."""
    p, g = clean(prediction), clean(gold)
    if p is None or g is None:
        return False
    by_value = by_value and "%" not in prediction
    p_eq, g_eq = clean(prediction, keep_assignment=True), clean(gold, keep_assignment=True)
    p_var, g_var = _ASSIGNMENT_LHS.match(p_eq), _ASSIGNMENT_LHS.match(g_eq)
    if p_var and g_var and _WHITESPACE.sub("", p_var.group(1)) != _WHITESPACE.sub("", g_var.group(1)):
        return False  # y = 5 against x = 5: a different variable
    if _same_text(p, g):
        return True
    if _is_word_answer(gold, g):  # \text{no}, AC, Monday: text, never a product of letters (on != no)
        return _text_key(p) == _text_key(g)
    g_num = number_value(g)
    if g_num is not None:
        spoken = word_number(p)  # forty-two, negative 5, one hundred and five, 1.5 million (prediction side only)
        if spoken is not None:
            return spoken == g_num
    if "\\cup" in p and "\\cup" in g:  # unions of intervals / sets: a set of pieces, in any order
        pieces_p, pieces_g = _split_top(p, ("\\cup",)), _split_top(g, ("\\cup",))
        if len(pieces_p) >= 2 and len(pieces_g) >= 2 and all(pieces_p) and all(pieces_g):
            return _pieces_equal(pieces_p, pieces_g, symbolic, by_value)
    if ("=" in p) != ("=" in g):  # 2x + y = 5 against y = 5 - 2x: compare the whole equations
        if p_eq.count("=") == 1 and g_eq.count("=") == 1 and "," not in p_eq + g_eq:
            return _equation(p_eq, g_eq, symbolic)
    kind_g, parts_g = structure(g)
    kind_p, parts_p = structure(p)
    if kind_p == "set" and len(parts_p) == 1 and kind_g == "scalar":  # \{3\} against 3
        kind_p, parts_p, p = "scalar", parts_p[0], parts_p[0]
    if kind_g == "scalar" and g.count(_PM) == 1 and kind_p in ("list", "set"):  # a \pm b: two values
        kind_g, parts_g = "list", [g.replace(_PM, "+"), g.replace(_PM, "-")]
        if parts_g[0].startswith("+"):
            parts_g[0] = parts_g[0][1:]
    if g_num is not None and kind_p == "scalar":
        return _leaf(p, g, symbolic, by_value)
    if kind_g == "scalar":
        if kind_p != "scalar":
            return False  # several values against one: a hedge
        return _leaf(p, g, symbolic, by_value)
    if kind_g == "matrix":
        if kind_p != "matrix" or [len(r) for r in parts_p] != [len(r) for r in parts_g]:
            return False
        return _all([_leaf(a, b, symbolic, by_value) for ra, rb in zip(parts_p, parts_g) for a, b in zip(ra, rb)])
    if kind_g == "seq":
        open_g, close_g, elems_g = parts_g
        if kind_p == "seq":
            open_p, close_p, elems_p = parts_p
            if (open_p, close_p) != (open_g, close_g):
                return False
        elif kind_p == "list" and (open_g, close_g) == ("(", ")"):
            elems_p = parts_p
        else:
            return False
        if len(elems_p) != len(elems_g):
            return False
        return _all([_leaf(a, b, symbolic, by_value) for a, b in zip(elems_p, elems_g)])
    # gold set or bare list: order-free
    if kind_p in ("set", "list"):
        elems_p = parts_p
    elif kind_p == "seq" and parts_p[:2] == ("(", ")"):
        elems_p = parts_p[2]
    else:
        return False
    return _multiset_equal(elems_p, parts_g, symbolic, by_value)


def _all(verdicts: list[bool | None]) -> bool | None:
    if any(v is False for v in verdicts):
        return False
    return None if any(v is None for v in verdicts) else True


def _same_text(p: str, g: str) -> bool:
    """Equal strings, or equal up to whitespace unless that would join two numbers (``2 1/2`` is not
    ``21/2``; ``1 000`` has been joined by ``clean`` already)."""
    if p == g:
        return True
    if _SPACED_DIGITS.search(p) or _SPACED_DIGITS.search(g):
        return _WHITESPACE.sub(" ", p).strip() == _WHITESPACE.sub(" ", g).strip()
    return _WHITESPACE.sub("", p) == _WHITESPACE.sub("", g)


def _pieces_equal(a: list[str], b: list[str], symbolic: Symbolic | None, by_value: bool) -> bool | None:
    """The pieces of two unions (``(-\\infty, 0) \\cup (1, \\infty)``) as a multiset, each piece compared with
    ``compare`` (an interval keeps its order and brackets)."""
    return _multiset_equal(a, b, symbolic, by_value,
                           leaf=lambda x, y, sym, bv: compare(x, y, sym, by_value=bv))


def _multiset_equal(a: list[str], b: list[str], symbolic: Symbolic | None, by_value: bool = False,
                    leaf: Callable | None = None) -> bool | None:
    if len(a) != len(b):
        return False
    leaf = leaf or _leaf
    unmatched = list(range(len(b)))
    undecided = False
    for x in a:
        hit = None
        for j in unmatched:
            v = leaf(x, b[j], symbolic, by_value)
            if v:
                hit = j
                break
            undecided |= v is None
        if hit is None:
            return None if undecided else False
        unmatched.remove(hit)
    return True


def _number_matches(p: str, g_num: Fraction) -> bool:
    p_num = number_value(p)
    if p_num is None:
        return False
    if p_num == g_num:
        return True
    if not _terminates(g_num) and _significant_digits(p) >= TOL_MIN_DIGITS:
        return abs(p_num - g_num) <= _last_place(p)
    return False


def _leaf(p: str, g: str, symbolic: Symbolic | None, by_value: bool = False) -> bool | None:
    """One value against one value (``by_value``: see ``compare``)."""
    p, g = p.strip(), g.strip()
    if _same_text(p, g):
        return True
    g_num, p_num = number_value(g), number_value(p)
    if g_num is not None:
        if p_num is not None or not (by_value or re.search(r"[\\^!|]", p)):
            return _number_matches(p, g_num)  # arithmetic left in a plain answer (2+2) does not count
        # a LaTeX expression against a number (\sqrt{16}, \binom{5}{2}, \boxed{40+2}): by value, below
    if _is_text(g) or _is_text(p):
        return _text_key(p) == _text_key(g)
    if "=" in p or "=" in g:
        return _equation(p, g, symbolic)
    if "\\infty" in p or "\\infty" in g:
        return _WHITESPACE.sub("", p).replace("+", "") == _WHITESPACE.sub("", g).replace("+", "")
    tree_g, tree_p = _tree(g), _tree(p)
    if tree_g is None and g_num is not None:  # a gold number the grammar does not read (1,000,000)
        tree_g = ("num", g_num)
    if tree_g is not None and tree_p is not None:
        if p_num is not None:  # a decimal against an irrational constant: the documented tolerance
            value = math_parse.constant_value(tree_g)
            if value is not None and value.imag == 0 and _significant_digits(p) >= TOL_MIN_DIGITS:
                return abs(float(p_num) - value.real) <= float(_last_place(p)) * (1 + 1e-9)
        verdict = math_parse.same_value(tree_p, tree_g)
        if verdict is not None:
            return verdict
    elif not (_needs_sympy(p) or _needs_sympy(g)):
        return False  # outside the grammar for a reason sympy would not fix either (``9**9``, ``2+``)
    if not (safe_for_symbolic(p) and safe_for_symbolic(g)):
        return False
    return symbolic(p, g) if symbolic is not None else None


def _needs_sympy(s: str) -> bool:
    """Whether ``s`` uses notation outside ``math_parse``'s grammar that the sympy tier reads (``\\binom``,
    subscripts, factorials, absolute values, inequalities, set operations, ``\\pm``)."""
    return bool(_SYMPY_ONLY.search(s))


def _tree(s: str) -> tuple | None:
    try:
        return math_parse.parse(s)
    except (math_parse.ParseError, RecursionError):
        return None


def _equation(p: str, g: str, symbolic: Symbolic | None) -> bool | None:
    sides_p, sides_g = _split_top(p, ("=",)), _split_top(g, ("=",))
    if len(sides_p) != 2 or len(sides_g) != 2:
        return False
    diff_p = f"({sides_p[0]})-({sides_p[1]})"
    diff_g, neg_g = f"({sides_g[0]})-({sides_g[1]})", f"({sides_g[1]})-({sides_g[0]})"
    first = _leaf(diff_p, diff_g, symbolic)
    if first:
        return True
    second = _leaf(diff_p, neg_g, symbolic)
    if second:
        return True
    return None if first is None or second is None else False


def _is_text(s: str) -> bool:
    """A word answer (``Monday``, ``(A)``, ``no solution``): letters only, with a run of >= 3 letters, or
    a single option letter in parentheses."""
    if _OPTION.fullmatch(s) and s.startswith("("):
        return True
    if not _TEXTLIKE.fullmatch(s) or "\\" in s:
        return False
    return re.search(r"[A-Za-z]{3}", s) is not None


def _is_word_answer(raw: str, cleaned: str) -> bool:
    """Whether a gold answer is a word, compared as text (case-insensitive) and never as algebra: the
    whole answer is one ``\\text{...}``-style wrapper holding letters, or a bare run of >= 2 letters
    that is not a function name (``pi``, ``sin``, ``ln``) and has a capital or a vowel (``AC``, ``no``,
    ``ab``). A lowercase run without vowels (``xy``, ``mn``) stays algebra, so ``yx == xy``; ``ba != ab``
    (ambiguous in MATH answers; read as text)."""
    if not _WORD.fullmatch(cleaned):
        return False
    if _TEXT_WRAPPED.fullmatch(raw.strip().strip("$").strip()):
        return True
    if " " in cleaned or cleaned.lower() in _FUNCTION_WORDS:
        return False
    return cleaned != cleaned.lower() or any(c in "aeiou" for c in cleaned)


def _text_key(s: str) -> str:
    s = _WHITESPACE.sub(" ", s).strip().strip(".").lower()
    m = _OPTION.fullmatch(s)
    return m.group(1) if m else s


MAX_SYMBOLIC_CHARS = 200    # answers longer than this never reach the sympy worker
MAX_SYMBOLIC_NESTING = 8    # bracket depth
MAX_SYMBOLIC_MARKS = 12     # ^, _ and ! together (ANTLR's prediction slows down sharply on long chains)


def safe_for_symbolic(s: str) -> bool:
    """Whether ``s`` may go to the sympy worker: at most ``MAX_SYMBOLIC_CHARS`` characters, bracket depth
    ``MAX_SYMBOLIC_NESTING``, ``MAX_SYMBOLIC_MARKS`` of ``^ _ !``, only math characters and known commands,
    no ``__`` (nothing that reads like code). Realistic answers that need sympy are far smaller; the
    worker's time limit is the second line of defence, not the first."""
    if len(s) > MAX_SYMBOLIC_CHARS or "__" in s or not _SAFE_CHARS.fullmatch(s):
        return False
    if sum(s.count(c) for c in "^_!") > MAX_SYMBOLIC_MARKS or _nesting(s) > MAX_SYMBOLIC_NESTING:
        return False
    return all(c[1:] in SAFE_COMMANDS or c in ("\\begin", "\\end") for c in _COMMAND.findall(s))


def _nesting(s: str) -> int:
    depth = deepest = 0
    for c in s:
        if c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth -= 1
    return deepest
