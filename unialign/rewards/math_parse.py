"""A small, bounded LaTeX-math reader for the math reward: tokenise, parse by a fixed grammar into a tuple
tree, check the tree, evaluate it numerically in floating point. Nothing is ever executed or handed to
``eval`` / ``sympify``; this module does not import sympy.

Grammar (recursive descent, one token of look-ahead)::

    expr    := term (("+" | "-") term)*
    term    := unary (("*" | "\\cdot" | "\\times" | "/" | "\\div" | <juxtaposition>) unary)*
    unary   := ("-" | "+") unary | power
    power   := postfix ("^" exponent)?          exponent := "{" expr "}" | digit | letter | "(" expr ")"
    postfix := atom "!"?                        (factorial of an integer <= MAX_FACTORIAL only)
    atom    := number | letter | "\\pi" | "(" expr ")" | "{" expr "}" | "[" expr "]" | "|" expr "|"
             | "\\lfloor" expr "\\rfloor" | "\\lceil" expr "\\rceil"
             | "\\frac" group group | "\\sqrt" ("[" expr "]")? group | function argument

``2\\frac{1}{2}`` (an integer's digits directly followed by ``\\frac`` of integers) is the mixed number 5/2, as
in school notation (``2(\\frac12)`` is a product); ``\\sin^2 x`` is ``(sin x)^2``. Two numbers separated only by
whitespace (``1 000``, ``2 3``) are outside the grammar, never a product (``1\\,000`` was once read as 1*000 = 0;
after ``_`` / ``^`` / ``\\frac`` / ``\\sqrt`` a digit argument may be followed by a number: ``\\log_2 8``).
Caps (``ParseError`` beyond them): ``MAX_EXPR_CHARS`` characters, ``MAX_TOKENS`` tokens, ``MAX_DEPTH`` nesting,
``MAX_NODES`` tree nodes, integer exponents ``|k| <= MAX_EXPONENT``, factorials of integers ``<= MAX_FACTORIAL``.
Evaluation is complex floating point (``cmath``), so no value can grow into a huge integer; an overflow or a
domain error is "no value".

Equality (``same_value``): trees of rational arithmetic compare exactly (``exact_value``); otherwise both are
evaluated at ``len(POINTS)`` fixed assignments of their free variables (letters; one point negative, so
``|x|``, ``\\sqrt{x^2}`` and ``\\ln x^2`` differ from ``x``, ``x``, ``2\\ln x``). A point where one side is
undefined and the other is not is a difference. Equal when every pair agrees to a relative
``TIGHT_REL_TOL`` (1e-13, no absolute floor); different when a pair differs by more than ``REL_TOL``
(1e-9); in between (a near tie such as ``\\sqrt{10^{12}+1}`` against ``10^6``) undecided here, for sympy.
"""

from __future__ import annotations

import cmath
import math
import re
from fractions import Fraction

MAX_EXPR_CHARS = 400
MAX_TOKENS = 200
MAX_DEPTH = 40
MAX_NODES = 300
MAX_EXPONENT = 1000
MAX_FACTORIAL = 100
REL_TOL = 1e-9

Node = tuple


class ParseError(ValueError):
    """The text is outside the grammar or over a cap."""


_TOKEN = re.compile(
    r"\s+|(?P<num>[0-9]+(?:\.[0-9]+)?|\.[0-9]+)|(?P<cmd>\\[A-Za-z]+|\\[{}|])|(?P<letter>[A-Za-z])"
    r"|(?P<op>[-+*/^(){}\[\]|!_])"
)
_SKIP_COMMANDS = {"\\left", "\\right", "\\displaystyle", "\\mathrm", "\\mathit", "\\big", "\\Big", "\\bigl",
                  "\\bigr", "\\Bigl", "\\Bigr"}
_MUL_COMMANDS = {"\\cdot", "\\times", "\\ast"}
_FUNCTIONS = {
    "\\sin": cmath.sin, "\\cos": cmath.cos, "\\tan": cmath.tan, "\\arcsin": cmath.asin,
    "\\arccos": cmath.acos, "\\arctan": cmath.atan, "\\sinh": cmath.sinh, "\\cosh": cmath.cosh,
    "\\tanh": cmath.tanh, "\\ln": cmath.log, "\\log": cmath.log, "\\exp": cmath.exp,
    "\\sec": lambda z: 1 / cmath.cos(z), "\\csc": lambda z: 1 / cmath.sin(z), "\\cot": lambda z: 1 / cmath.tan(z),
}
_GREEK = {"\\alpha", "\\beta", "\\gamma", "\\delta", "\\theta", "\\lambda", "\\mu", "\\sigma", "\\phi",
          "\\omega"}
_ATOM_START = {"num", "letter", "(", "{", "[", "\\pi", "\\lfloor", "\\lceil", "\\frac", "\\dfrac", "\\tfrac", "\\sqrt", "\\{"}


def tokenize(text: str) -> list[tuple[str, str]]:
    """``text`` as ``(kind, value)`` tokens: kind ``num`` / ``letter`` / the operator or command itself.
    ParseError on any character outside the grammar or over the caps."""
    if len(text) > MAX_EXPR_CHARS:
        raise ParseError("too long")
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ParseError(f"unexpected {text[pos]!r}")
        pos = m.end()
        if m.group("num") is not None:
            if out and out[-1][0] == "num" and (len(out) < 2 or out[-2][0] not in ("_", "^", "\\frac", "\\sqrt")):
                # "1 000", "2 3": two numbers side by side are not a product (\log_2 8, x^2 3, \frac12 3 are)
                raise ParseError("two numbers side by side")
            out.append(("num", m.group("num")))
        elif m.group("letter") is not None:
            out.append(("letter", m.group("letter")))
        elif m.group("cmd") is not None:
            cmd = m.group("cmd")
            if cmd in ("\\dfrac", "\\tfrac"):
                cmd = "\\frac"
            if cmd in _SKIP_COMMANDS:
                continue
            out.append(("letter", cmd) if cmd in _GREEK else (cmd, cmd))
        elif m.group("op") is not None:
            out.append((m.group("op"), m.group("op")))
        if len(out) > MAX_TOKENS:
            raise ParseError("too many tokens")
    return out


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.i, self.depth, self.nodes = tokens, 0, 0, 0

    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.tokens[j][0] if j < len(self.tokens) else None

    def take(self, kind: str | None = None) -> tuple[str, str]:
        if self.i >= len(self.tokens) or (kind is not None and self.tokens[self.i][0] != kind):
            raise ParseError(f"expected {kind}")
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def node(self, *parts) -> Node:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ParseError("too many nodes")
        return parts

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError("too deep")

    def expr(self) -> Node:
        self.enter()
        left = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[0]
            right = self.term()
            left = self.node("add", left, right if op == "+" else self.node("neg", right))
        self.depth -= 1
        return left

    def term(self) -> Node:
        left = self.unary()
        while True:
            kind = self.peek()
            if kind in _MUL_COMMANDS or kind == "*":
                self.take()
                left = self.node("mul", left, self.unary())
            elif kind in ("/", "\\div"):
                self.take()
                left = self.node("div", left, self.unary())
            elif kind in _ATOM_START or kind in _FUNCTIONS:
                # 2\frac{1}{2} = 5/2 only when the \frac directly follows the integer's digits: never
                # through brackets (2(\frac12) and 2\left(\frac12\right) are products)
                mixed = kind == "\\frac" and self.i > 0 and self.tokens[self.i - 1][0] == "num"
                right = self.unary()
                if mixed and _is_integer_literal(left) and _is_proper_fraction(right):
                    left = self.node("add", left, right)
                else:
                    left = self.node("mul", left, right)
            else:
                return left

    def unary(self) -> Node:
        if self.peek() in ("-", "+"):
            op = self.take()[0]
            self.enter()
            inner = self.unary()
            self.depth -= 1
            return self.node("neg", inner) if op == "-" else inner
        return self.power()

    def power(self) -> Node:
        base = self.postfix()
        if self.peek() == "^":
            self.take()
            return self.node("pow", base, self.exponent())
        return base

    def bare_argument(self) -> Node | None:
        """A command's argument without braces, as LaTeX reads it: ``{expr}``, one digit of a number (the rest
        stays the next token: ``^23`` is ``^{2}3``, ``\\frac12`` is ``\\frac{1}{2}``; a decimal number whole) or
        one letter; None before anything else."""
        kind = self.peek()
        if kind == "{":
            return self.group()
        if kind == "num":
            digits = self.take()[1]
            if len(digits) > 1 and "." not in digits:
                self.i -= 1
                self.tokens[self.i] = ("num", digits[1:])
                digits = digits[0]
            return self.node("num", Fraction(digits))
        if kind == "letter":
            return self.node("var", self.take()[1])
        return None

    def exponent(self) -> Node:
        arg = self.bare_argument()
        if arg is not None:
            return arg
        kind = self.peek()
        if kind == "(":
            return self.atom()
        if kind == "-":
            self.take()
            return self.node("neg", self.exponent())
        raise ParseError("bad exponent")

    def postfix(self) -> Node:
        base = self.atom()
        if self.peek() == "!":
            self.take()
            if not (base[0] == "num" and float(base[1]).is_integer() and 0 <= base[1] <= MAX_FACTORIAL):
                raise ParseError("factorial of a non-integer or too large")
            return self.node("num", Fraction(math.factorial(int(base[1]))))
        return base

    def group(self) -> Node:
        self.take("{")
        inner = self.expr()
        self.take("}")
        return inner

    def atom(self) -> Node:
        kind = self.peek()
        if kind == "num":
            return self.node("num", Fraction(self.take()[1]))
        if kind == "letter":
            return self.node("var", self.take()[1])
        if kind == "\\pi":
            self.take()
            return self.node("num", math.pi)
        if kind in ("(", "[", "{", "|"):
            close = {"(": ")", "[": "]", "{": "}", "|": "|"}[kind]
            self.take()
            inner = self.expr()
            self.take(close)
            return self.node("abs", inner) if kind == "|" else inner
        if kind in ("\\lfloor", "\\lceil"):
            self.take()
            inner = self.expr()
            self.take("\\rfloor" if kind == "\\lfloor" else "\\rceil")
            return self.node("floor" if kind == "\\lfloor" else "ceil", inner)
        if kind == "\\frac":
            self.take()
            num, den = self.frac_arg(), self.frac_arg()
            return self.node("div", num, den)
        if kind == "\\sqrt":
            self.take()
            index = None
            if self.peek() == "[":
                self.take()
                index = self.expr()
                self.take("]")
            radicand = self.frac_arg()
            return self.node("root", radicand, index if index is not None else self.node("num", Fraction(2)))
        if kind in _FUNCTIONS:
            name = self.take()[0]
            base = None
            if name == "\\log" and self.peek() == "_":
                self.take()
                base = self.frac_arg()
            power = None
            if self.peek() == "^":
                self.take()
                power = self.exponent()
            if self.peek() in ("(", "{", "["):
                arg = self.atom()
            else:
                arg = self.unary_power_chain()
            out = self.node("fn", name, arg)
            if base is not None:
                out = self.node("div", out, self.node("fn", "\\ln", base))
            return self.node("pow", out, power) if power is not None else out
        raise ParseError(f"unexpected {kind}")

    def frac_arg(self) -> Node:
        """``{expr}`` or a single digit / letter (``\\frac12``, ``\\sqrt2``)."""
        arg = self.bare_argument()
        if arg is None:
            raise ParseError("bad argument")
        return arg

    def unary_power_chain(self) -> Node:
        """The argument of ``\\sin 2x``: juxtaposed factors up to the next operator."""
        left = self.power()
        while self.peek() in ("num", "letter", "\\pi"):
            left = self.node("mul", left, self.power())
        return left


def _is_integer_literal(node: Node) -> bool:
    return node[0] == "num" and float(node[1]).is_integer() and node[1] >= 0


def _is_proper_fraction(node: Node) -> bool:
    return (node[0] == "div" and _is_integer_literal(node[1]) and _is_integer_literal(node[2])
            and 0 < node[1][1] < node[2][1])


def parse(text: str) -> Node:
    """The tuple tree of one LaTeX expression (``ParseError`` when outside the grammar or caps)."""
    parser = _Parser(tokenize(text))
    if not parser.tokens:
        raise ParseError("empty")
    tree = parser.expr()
    if parser.i != len(parser.tokens):
        raise ParseError(f"trailing {parser.tokens[parser.i][1]!r}")
    return tree


def free_letters(node: Node) -> set[str]:
    if node[0] == "var":
        return {node[1]}
    out: set[str] = set()
    for part in node[1:]:
        if isinstance(part, tuple):
            out |= free_letters(part)
    return out


def evaluate(node: Node, env: dict[str, complex]) -> complex:
    """The complex value of ``node`` with letters from ``env``; ``ArithmeticError`` / ``ValueError`` on
    overflow, division by zero or a domain error."""
    kind = node[0]
    if kind == "num":
        return complex(node[1])
    if kind == "var":
        return env[node[1]]
    if kind == "neg":
        return -evaluate(node[1], env)
    if kind == "abs":
        return complex(abs(evaluate(node[1], env)))
    if kind in ("floor", "ceil"):
        v = evaluate(node[1], env)
        if v.imag != 0:
            raise ValueError("floor of a complex value")
        return complex(math.floor(v.real) if kind == "floor" else math.ceil(v.real))
    if kind == "fn":
        return _FUNCTIONS[node[1]](evaluate(node[2], env))
    a, b = evaluate(node[1], env), evaluate(node[2], env)
    if kind == "add":
        return a + b
    if kind == "mul":
        return a * b
    if kind == "div":
        return a / b
    if kind == "pow":
        if abs(b) > MAX_EXPONENT:
            raise OverflowError("exponent over the cap")
        ratio = exact_value(node[2]) if a.imag == 0 and a.real < 0 else None
        if ratio is not None and ratio.denominator % 2 == 1 and ratio.denominator > 1:  # (-8)^{1/3} = -2
            return complex((-1) ** (ratio.numerator % 2) * (-a.real) ** float(ratio))
        if abs(b) > MAX_EXPONENT:
            raise OverflowError("exponent over the cap")
        if b.imag == 0 and b.real.is_integer():
            return a ** int(b.real) if b.real >= 0 else 1 / a ** int(-b.real)
        if a.imag == 0 and a.real > 0:
            return complex(a.real ** b.real) if b.imag == 0 else cmath.exp(b * cmath.log(a))
        return a ** b
    if kind == "root":
        if b.imag == 0 and b.real.is_integer() and int(b.real) % 2 == 1 and a.imag == 0 and a.real < 0:
            return complex(-((-a.real) ** (1 / b.real)))  # odd root of a negative real: real
        if b.imag == 0 and b.real == 2:
            return cmath.sqrt(a)
        return a ** (1 / b)
    raise ValueError(kind)


# fixed, irregular values for free letters (3 points, one negative, so |x| != x and \sqrt{x^2} != x); each
# letter is scaled by its own factor, the same on both sides
POINTS = (-1.3709254119, 0.6137811463, 2.4307166031)
TIGHT_REL_TOL = 1e-13   # agreement at every point this close (relative) is equality in double precision


def _env(letters: set[str], k: int) -> dict[str, complex]:
    return {c: complex(POINTS[k] * (1 + (sum(map(ord, c)) % 29) * 0.0373)) for c in letters}


def _value_at(node: Node, letters: set[str], k: int) -> complex | None:
    try:
        v = evaluate(node, _env(letters, k))
    except (ArithmeticError, ValueError, KeyError):
        return None
    return v if cmath.isfinite(v) else None


def values(node: Node, letters: set[str]) -> list[complex] | None:
    """``node`` evaluated at the fixed points; None when any value is undefined or not finite."""
    out = [_value_at(node, letters, k) for k in range(len(POINTS))]
    return None if any(v is None for v in out) else out


def close(a: complex, b: complex, rel: float = REL_TOL) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def tight(a: complex, b: complex) -> bool:
    """Equal up to double rounding: relative ``TIGHT_REL_TOL`` with no absolute floor (``e^{-100} != 0``)."""
    return abs(a - b) <= TIGHT_REL_TOL * max(abs(a), abs(b))


MAX_EXACT_BITS = 40_000  # numerator / denominator size of an exact power (about 12,000 digits)


def exact_value(node: Node) -> Fraction | None:
    """The exact rational value of a tree of rational literals, + - * /, integer powers (bounded size)
    and |.|; None for anything else (letters, pi, roots, functions) or over ``MAX_EXACT_BITS``."""
    kind = node[0]
    if kind == "num":
        return node[1] if isinstance(node[1], Fraction) else None
    if kind in ("var", "fn", "root"):
        return None
    if kind in ("neg", "abs", "floor", "ceil"):
        v = exact_value(node[1])
        if v is None:
            return None
        return {"neg": -v, "abs": abs(v), "floor": Fraction(math.floor(v)), "ceil": Fraction(math.ceil(v))}[kind]
    a, b = exact_value(node[1]), exact_value(node[2])
    if a is None or b is None:
        return None
    if kind == "add":
        out = a + b
    elif kind == "mul":
        out = a * b
    elif kind == "div":
        if b == 0:
            return None
        out = a / b
    elif kind == "pow":
        if b.denominator != 1 or abs(b) > MAX_EXPONENT or (a == 0 and b < 0):
            return None
        if max(a.numerator.bit_length(), a.denominator.bit_length()) * abs(int(b)) > MAX_EXACT_BITS:
            return None
        out = a ** int(b)
    else:
        return None
    if max(out.numerator.bit_length(), out.denominator.bit_length()) > MAX_EXACT_BITS:
        return None
    return out


def same_value(a: Node, b: Node, rel: float = REL_TOL) -> bool | None:
    """True / False when both trees have finite values at every point; None when undecidable here.
    Two trees of rational arithmetic compare exactly (``2^{100}+1 != 2^{100}``)."""
    exact_a, exact_b = exact_value(a), exact_value(b)
    if exact_a is not None and exact_b is not None:
        return exact_a == exact_b
    letters = free_letters(a) | free_letters(b)
    pairs = [(_value_at(a, letters, k), _value_at(b, letters, k)) for k in range(len(POINTS))]
    if any((x is None) != (y is None) for x, y in pairs):
        return False  # defined on one side only (\ln x at x < 0 against \ln x^2 is not; here: complex, so rare)
    pairs = [(x, y) for x, y in pairs if x is not None]
    if not pairs:
        return None
    if not all(close(x, y, rel) for x, y in pairs):
        return False
    if all(tight(x, y) for x, y in pairs):
        return True
    return None  # a near tie (\sqrt{10^{12}+1} against 10^6, \pi + 10^{-10} against \pi): sympy decides


def constant_value(node: Node) -> complex | None:
    """The value of a tree without letters, else None."""
    if free_letters(node):
        return None
    v = values(node, set())
    return v[0] if v else None
