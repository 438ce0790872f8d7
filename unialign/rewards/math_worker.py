"""The symbolic tier of the math reward: sympy in a separate, killable worker process.

Only answers that the in-process rules (``math_compare``) cannot decide come here, and only when both
pass ``math_compare.safe_for_symbolic`` (short, math characters and known LaTeX commands only).
The worker parses each side with ``latex2sympy2_extended`` (an ANTLR grammar that builds unevaluated
sympy trees; never ``sympify`` / ``parse_expr`` / ``eval`` on text), checks the tree before using it
(``check_tree``: at most ``MAX_NODES`` nodes, depth ``MAX_DEPTH``, every power's result under
``MAX_LOG10`` decimal digits and its exponent under ``MAX_EXPONENT``, factorials of at most
``MAX_FACTORIAL``), then compares: values at three rational points of the free symbols (one negative),
``SYMPY_DIGITS`` digits, relative ``SYMPY_REL_TOL``; ``sympy.simplify(a - b) == 0`` where values are not numbers.

``SymbolicWorker`` (client): one persistent child (``python -I`` loading this file; torch never imported) speaking
JSON lines over pipes (no pickle). Each request has a hard wall-clock limit; a request that overruns gets
the process **killed** (SIGKILL: runaway sympy work really stops) and a fresh one is started for the next
request. The child caps its address space at ``WORKER_MEMORY_BYTES``. Start-up (importing sympy, ~1 s)
is not charged to a sample's limit.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

MAX_NODES = 400
MAX_DEPTH = 60
MAX_EXPONENT = 1000
MAX_LOG10 = 10_000
MAX_FACTORIAL = 100
SYMPY_REL_TOL = 1e-30     # at SYMPY_DIGITS digits; relative only (e^{-100} != 0)
SYMPY_DIGITS = 50
WORKER_MEMORY_BYTES = 2 << 30
STARTUP_TIMEOUT_S = 60.0
CACHE_SIZE = 4096


# ----------------------------------------------------------------------------------------- child side
class TreeTooLarge(ValueError):
    pass


def check_tree(expr) -> None:
    """Raise ``TreeTooLarge`` unless ``expr`` is within the caps (see the module docstring)."""
    import sympy

    count = 0
    stack = [(expr, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES or depth > MAX_DEPTH:
            raise TreeTooLarge("tree too large or deep")
        if isinstance(node, sympy.MatrixBase):
            stack.extend((x, depth + 1) for x in node)
            continue
        if not isinstance(node, sympy.Basic):
            continue
        if isinstance(node, sympy.Pow) or isinstance(node, sympy.exp):
            _log10_bound(node)
        if isinstance(node, (sympy.factorial, sympy.factorial2, sympy.gamma, sympy.binomial)):
            _log10_bound(node)
        stack.extend((a, depth + 1) for a in node.args)


def _log10_bound(node) -> float:
    """An upper bound of log10 |node| (1 for a symbol); TreeTooLarge when a power could be huge."""
    import math

    import sympy

    if isinstance(node, sympy.Number):
        v = abs(node)
        if v == 0:
            return 0.0
        if isinstance(node, sympy.Rational):  # Integer included; exact ints, so no float overflow
            return math.log10(abs(int(node.p))) - math.log10(int(node.q)) + 1e-9
        return max(math.log10(float(v)), 0.0) if v < sympy.Float("1e300") else 300.0
    if node.is_Symbol or node in (sympy.pi, sympy.E, sympy.I) or isinstance(node, sympy.NumberSymbol):
        return 1.0
    if isinstance(node, sympy.Pow) or isinstance(node, sympy.exp):
        base, exponent = (node.args[0], node.args[1]) if isinstance(node, sympy.Pow) else (sympy.E, node.args[0])
        e_bound = _log10_bound(exponent)
        if e_bound > math.log10(MAX_EXPONENT) + 1e-6:
            raise TreeTooLarge("exponent too large")
        out = max(_log10_bound(base), 0.0) * 10 ** e_bound
        if out > MAX_LOG10:
            raise TreeTooLarge("power too large")
        return out
    if isinstance(node, (sympy.factorial, sympy.factorial2, sympy.gamma)):
        n = 10 ** _log10_bound(node.args[0])
        if n > MAX_FACTORIAL:
            raise TreeTooLarge("factorial too large")
        return n * math.log10(max(n, 2))
    if isinstance(node, sympy.binomial):
        n = 10 ** _log10_bound(node.args[0])
        if n > 10 * MAX_FACTORIAL:
            raise TreeTooLarge("binomial too large")
        return n * 0.302
    args = [a for a in getattr(node, "args", ()) if isinstance(a, sympy.Basic)]
    if not args:
        return 1.0
    bounds = [_log10_bound(a) for a in args]
    if isinstance(node, sympy.Mul):
        return sum(bounds)
    return max(bounds) + math.log10(len(bounds))


def to_sympy(text: str):
    """The checked sympy tree of one LaTeX answer, or None (parse failure or over a cap)."""
    from latex2sympy2_extended import latex2sympy

    try:
        expr = latex2sympy(text, normalization_config=None)
        check_tree(expr)
        return expr
    except Exception:  # noqa: BLE001 - any parse or check failure is "no tree"
        return None


def sympy_equal(p: str, g: str) -> bool | None:
    """Leaf comparison with sympy (child side)."""
    import sympy

    a, b = to_sympy(p), to_sympy(g)
    if a is None or b is None:
        return None
    if a == b:
        return True
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
        try:
            return bool(sympy.simplify(a) == sympy.simplify(b))
        except Exception:  # noqa: BLE001
            return None
    if not (a.free_symbols or b.free_symbols):  # two rational constants compare exactly (2^100 + 1 != 2^100)
        try:
            exact_a, exact_b = a.doit(), b.doit()
            if exact_a.is_Rational and exact_b.is_Rational:
                return bool(exact_a == exact_b)
        except Exception:  # noqa: BLE001
            pass
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    points = [sympy.Rational(-1371, 1000), sympy.Rational(614, 1000), sympy.Rational(2431, 1000)]  # one negative
    numeric = True
    for k, base in enumerate(points):
        subs = {s: base + sympy.Rational(31 * (i + 1) * (k + 1), 1000) for i, s in enumerate(symbols)}
        try:
            va, vb = sympy.N(a.subs(subs), SYMPY_DIGITS), sympy.N(b.subs(subs), SYMPY_DIGITS)
        except Exception:  # noqa: BLE001
            numeric = False
            break
        if not (va.is_number and vb.is_number) or va.has(sympy.nan, sympy.zoo) or vb.has(sympy.nan, sympy.zoo):
            numeric = False
            break
        if not (va.is_finite and vb.is_finite):
            numeric = False
            break
        # in sympy Floats (unbounded exponent range): a huge value never overflows into inf == inf
        if (va == 0) != (vb == 0):  # exactly zero against a tiny value: only simplify can tell
            numeric = False
            break
        if sympy.Abs(va - vb) > SYMPY_REL_TOL * sympy.Max(sympy.Abs(va), sympy.Abs(vb)):
            return False
    if numeric:
        return True
    try:
        return bool(sympy.simplify(a - b) == 0)
    except Exception:  # noqa: BLE001
        return None


_DIGITS = None


def number_from_digits(text: str):
    """A sympy Integer / Rational from a number token (``12``, ``1,000``, ``0.25``, ``.5``) without
    ``sympify``; ValueError for anything else or over 400 digits."""
    import re

    import sympy

    global _DIGITS
    if _DIGITS is None:
        _DIGITS = re.compile(r"([0-9]*)(?:\.([0-9]*))?")
    text = text.replace(",", "").replace(" ", "").strip()
    m = _DIGITS.fullmatch(text)
    if not m or not text.strip(".") or len(text) > 400:
        raise ValueError(f"not a number token: {text[:40]!r}")
    whole, frac = m.group(1) or "0", m.group(2) or ""
    if not frac:
        return sympy.Integer(int(whole))
    return sympy.Rational(int(whole + frac), 10 ** len(frac))


def forbid_text_evaluation() -> None:
    """Defence in depth in the child: ``eval`` and sympy's text parser
    (``parse_expr``, which ``sympify(str)`` calls) raise from here on, so no path through sympy or
    latex2sympy2_extended can evaluate text. Called after the imports and the warm-up."""
    import builtins

    import latex2sympy2_extended.latex2sympy2 as l2s
    import sympy.parsing.sympy_parser as parser

    def forbidden(*args, **kwargs):
        raise RuntimeError("evaluating text is disabled in the math worker")

    parser.parse_expr = parser.eval_expr = l2s.parse_expr = forbidden
    # latex2sympy2_extended builds number tokens with sympy.Number(text), i.e. sympify(text) -> parse_expr
    # -> eval: digits only (the ANTLR lexer's NUMBER token), yet text evaluation all the same. Numbers are
    # built from the digits here instead.
    l2s._Latex2Sympy.parse_number = lambda self, text: number_from_digits(text)
    l2s.convert_number = number_from_digits
    builtins.eval = forbidden  # exec / compile stay: the import machinery runs modules with them


def serve() -> None:
    """Child main loop: one JSON request per line in, one JSON verdict per line out."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    import sympy  # noqa: F401 - import cost paid before "ready"
    from latex2sympy2_extended import latex2sympy

    from unialign.rewards.math_compare import compare

    latex2sympy("\\frac{1}{2}", normalization_config=None)  # warm the ANTLR tables
    forbid_text_evaluation()
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            verdict = compare(req["p"], req["g"], symbolic=sympy_equal, by_value=bool(req.get("v")))
        except Exception:  # noqa: BLE001 - MemoryError / RecursionError included: "no verdict"
            verdict = None
        out.write(json.dumps({"r": verdict}) + "\n")
        out.flush()


# ----------------------------------------------------------------------------------------- parent side
class SymbolicWorker:
    """A persistent sympy child process with a hard per-request limit (see the module docstring).
    Thread-safe (one request at a time). ``restarts`` counts kills."""

    def __init__(self, startup_timeout_s: float = STARTUP_TIMEOUT_S, command: list[str] | None = None):
        self.startup_timeout_s = startup_timeout_s
        # the child's command line (tests substitute a child that hangs, to check the kill)
        self.command = command or [sys.executable, "-I", "-c", _BOOTSTRAP, str(Path(__file__).resolve())]
        self._proc: subprocess.Popen | None = None
        self._owner = os.getpid()  # a forked copy of this object must not share the parent's pipes
        self._buf = b""
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], bool | None] = OrderedDict()
        self.restarts = 0
        self.available = _dependency_available()

    def compare(self, prediction: str, gold: str, timeout_s: float, *, by_value: bool = False) -> bool | None:
        """The child's verdict, or None when it overran ``timeout_s`` (the child is killed), failed, or
        sympy / latex2sympy2_extended are not installed. ``by_value``: as in ``math_compare.compare``."""
        if not self.available:
            return None
        key = (prediction, gold, by_value)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            verdict = self._request({"p": prediction, "g": gold, "v": by_value}, timeout_s)
            if verdict != "timeout":
                self._cache[key] = verdict
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            return None if verdict == "timeout" else verdict

    def _request(self, req: dict, timeout_s: float):
        if not self._ensure_started():
            return None
        try:
            os.write(self._proc.stdin.fileno(), (json.dumps(req) + "\n").encode())
        except OSError:
            self.close()
            return None
        line = self._read_line(timeout_s)
        if line is None:
            self.restarts += 1
            self.close()  # SIGKILL: the runaway work stops here
            return "timeout"
        try:
            return json.loads(line)["r"]
        except (ValueError, KeyError):
            return None

    def _ensure_started(self) -> bool:
        if self._owner != os.getpid():  # inherited through fork: leave the parent's child alone
            self._proc, self._buf, self._owner = None, b"", os.getpid()
        if self._proc is not None and self._proc.poll() is None:
            return True
        self.close()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            self._proc = subprocess.Popen(self.command, env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError:
            self._proc = None
            return False
        if self._read_line(self.startup_timeout_s) != b"ready":
            self.close()
            self.available = False  # a child that cannot start will not start next time either
            return False
        return True

    def _read_line(self, timeout_s: float) -> bytes | None:
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.strip()

    def close(self) -> None:
        proc, self._proc, self._buf = self._proc, None, b""
        if proc is not None and self._owner == os.getpid():
            try:
                proc.kill()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass


# the child loads this file by path (-I: no cwd / PYTHONPATH on sys.path, so nothing can shadow a module)
_BOOTSTRAP = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('unialign_math_worker', "
              "sys.argv[1]); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
              "m._stub_packages(); m.serve()")


def _dependency_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("sympy", "latex2sympy2_extended"))


_WORKER: SymbolicWorker | None = None
_WORKER_LOCK = threading.Lock()


def shared_worker() -> SymbolicWorker:
    """The process-wide worker (created on first use, killed at exit)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = SymbolicWorker()
            atexit.register(_WORKER.close)
        return _WORKER


def _stub_packages() -> None:
    """Child start-up: make ``unialign.rewards.math_compare`` importable without running the package
    ``__init__`` files (which import torch: seconds of start-up and gigabytes of address space)."""
    import types

    here = Path(__file__).resolve().parent
    for name, path in (("unialign", here.parent), ("unialign.rewards", here)):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            sys.modules[name] = module


if __name__ == "__main__":
    _stub_packages()
    serve()
