"""One reward call under a wall-clock limit (``--reward_timeout``), without changing how the call runs.

``call_with_deadline(fn, timeout_s)`` runs ``fn()`` and raises ``CallTimedOut`` when it has not returned after
``timeout_s`` seconds.

* In the main thread of a POSIX process (the trainers' case) the call runs **in the main thread, as without a
  limit** (thread-local state -- grad mode, autocast, the CUDA device -- and libraries that time themselves
  with ``signal.alarm``, such as math-verify, TRL's accuracy reward, keep working). A watchdog thread waits;
  when the time is up it sends the main thread the real-time signal ``DEADLINE_SIGNAL``, whose handler raises
  ``_Deadline`` (a ``BaseException``: a reward's ``except Exception`` does not swallow it) where the call is:
  Python code, ``time.sleep``, a blocking read or lock wait (PEP 475: the handler's exception ends the system
  call). The call is really stopped and unwinds (its ``finally`` blocks run); the signal is sent again every
  second until it has. The handler stays installed once set (a late signal is ignored, never fatal).
* Elsewhere (a call from another thread, no ``pthread_kill``) the call runs on a daemon thread (grad mode and
  the CUDA device carried over) and is **abandoned** on timeout: a Python thread cannot be killed, so it runs
  on in the background (``abandoned_calls()`` counts those still alive).

A result that comes back after the limit (a call that caught the stop and returned anyway) is discarded: the call
counts as timed out.

Nothing inside the process can stop C code that never releases the GIL (a catastrophic regex, one huge ``int()``),
nor a call that catches the stop again and again. So, in the main-thread mode, a call that has not unwound
``hard_stop_after(timeout_s)`` seconds after its limit ends the process: a small watchdog process (started once,
outside the GIL) prints one line naming the call and sends SIGKILL. The run's last checkpoint is whole (checkpoints
are written atomically); bound such work by design instead (``map_with_time_limit``, the math reward's killable
worker).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

DEADLINE_SIGNAL = signal.SIGRTMIN + 13 if hasattr(signal, "SIGRTMIN") else None  # rarely used by anything else
RESEND_S = 1.0  # while an interrupted call has not unwound, signal it again this often


class _Deadline(BaseException):
    """Raised inside a call whose time is up."""


class CallTimedOut(Exception):
    """``fn`` did not return within ``seconds``; ``where`` is the ``file:line in function`` it was stopped at
    (None when it was abandoned on a thread), ``abandoned``: it still runs on a background thread."""

    def __init__(self, seconds: float, where: str | None, abandoned: bool):
        self.seconds, self.where, self.abandoned = seconds, where, abandoned
        how = f"interrupted at {where}" if where else "abandoned: it still runs in a background thread"
        super().__init__(f"no result within {seconds:g} s ({how})")


class _Call:
    __slots__ = ("finished", "expired")

    def __init__(self) -> None:
        self.finished, self.expired = threading.Event(), False


_armed: list[_Call] = []  # the main thread's call under a deadline (at most one: nested calls share it)
_previous: Any = None  # the handler DEADLINE_SIGNAL had before ours
_abandoned: list[threading.Thread] = []


def _handler(signum: int, frame: Any) -> None:
    call = _armed[-1] if _armed else None
    ours = frame is not None and frame.f_code.co_filename == __file__  # this module's own bookkeeping: never here
    if call is not None and call.expired and not call.finished.is_set() and not ours:
        raise _Deadline
    if callable(_previous):
        _previous(signum, frame)


def _can_interrupt() -> bool:
    return (DEADLINE_SIGNAL is not None and hasattr(signal, "pthread_kill")
            and threading.current_thread() is threading.main_thread())


def _install() -> bool:
    global _previous
    current = signal.getsignal(DEADLINE_SIGNAL)
    if current is _handler:
        return True
    try:
        signal.signal(DEADLINE_SIGNAL, _handler)
    except (ValueError, OSError):  # not the main interpreter, or the signal is unavailable
        return False
    _previous = current
    return True


def abandoned_calls() -> int:
    """Calls abandoned on a timeout (thread mode) that are still running."""
    _abandoned[:] = [t for t in _abandoned if t.is_alive()]
    return len(_abandoned)


def call_with_deadline(fn: Callable[[], T], timeout_s: float | None, what: str = "the call") -> T:
    """``fn()``, or ``CallTimedOut`` after ``timeout_s`` seconds (None or <= 0: no limit, a plain call). ``what``
    names the call in the hard stop's line (module docstring)."""
    if not timeout_s or timeout_s <= 0:
        return fn()
    if _can_interrupt() and _install():
        return _interrupting(fn, float(timeout_s), what)
    return _on_thread(fn, float(timeout_s))


def hard_stop_after(timeout_s: float) -> float:
    """Seconds past its limit a call may take to unwind before the process is stopped: 5 to 60, as the limit."""
    return min(60.0, max(5.0, timeout_s))


def _interrupting(fn: Callable[[], T], timeout_s: float, what: str = "the call") -> T:
    if _armed:  # a call inside a call under a deadline: the outer deadline governs
        return fn()
    call, main = _Call(), threading.main_thread().ident
    grace = hard_stop_after(timeout_s)
    _WATCHDOG.arm(timeout_s + grace, f"error: {what} did not stop within {grace:g} s after its {timeout_s:g} s limit "
                  "(it holds the interpreter in C code, e.g. a catastrophic regex, or catches the stop), so the run "
                  "was killed; its last checkpoint is whole: fix or bound the call, then --resume_from_checkpoint "
                  "latest")

    def watch() -> None:
        if call.finished.wait(timeout_s):
            return
        call.expired = True
        while not call.finished.is_set():
            if signal.getsignal(DEADLINE_SIGNAL) is _handler:  # never deliver it to a default (fatal) disposition
                signal.pthread_kill(main, DEADLINE_SIGNAL)
            call.finished.wait(RESEND_S)

    watchdog = threading.Thread(target=watch, daemon=True, name="unialign-reward-deadline")
    _armed.append(call)
    watchdog.start()
    try:
        out = fn()
    except _Deadline as stop:
        raise CallTimedOut(timeout_s, _where(stop.__traceback__), abandoned=False) from None
    finally:
        call.finished.set()  # from here on a late signal is ignored
        watchdog.join()
        _armed.pop()
        _WATCHDOG.disarm()
    if call.expired:  # it caught the stop and returned after its limit: a late result is not a result
        raise CallTimedOut(timeout_s, "its return, after the limit (the stop was caught)", abandoned=False)
    return out


def _where(tb) -> str | None:
    """``file:line in function`` of the innermost frame outside this module."""
    frames = [f for f in traceback.extract_tb(tb) if Path(f.filename).resolve() != Path(__file__).resolve()]
    if not frames:
        return None
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}"


def _on_thread(fn: Callable[[], T], timeout_s: float) -> T:
    import torch

    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    out: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller as it is
            out["error"] = err
        finally:
            done.set()

    worker = threading.Thread(target=run, daemon=True, name="unialign-reward")
    worker.start()
    if not done.wait(timeout_s):
        _abandoned.append(worker)
        raise CallTimedOut(timeout_s, None, abandoned=True)
    if "error" in out:
        raise out["error"]
    return out["value"]


# ------------------------------------------------------------------ the hard stop
_WATCH_CODE = r"""
import os, select, signal, sys, time
parent, deadline, message, buf = int(sys.argv[1]), None, b"", b""
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([0], [], [], wait)
    if not ready:
        os.write(2, b"\n" + message + b"\n")
        os.kill(parent, signal.SIGKILL)
        break
    data = os.read(0, 65536)
    if not data:
        break  # the parent is gone
    buf += data
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        if line.startswith(b"arm "):
            seconds, _, message = line[4:].partition(b" ")
            deadline = time.monotonic() + float(seconds)
        elif line == b"disarm":
            deadline = None
"""


class _Watchdog:
    """A process outside this one's GIL that SIGKILLs it when an armed deadline passes (one per process, started
    on first use; it exits when this process does, its pipe closing)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._owner = -1

    def _pipe(self):
        if self._proc is None or self._owner != os.getpid() or self._proc.poll() is not None:
            self._owner = os.getpid()
            self._proc = subprocess.Popen([sys.executable, "-c", _WATCH_CODE, str(os.getpid())], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, close_fds=True)
        return self._proc.stdin

    def _send(self, line: str) -> None:
        try:
            pipe = self._pipe()
            pipe.write(line.replace("\n", " ").encode() + b"\n")
            pipe.flush()
        except OSError:  # no watchdog (a sandbox without subprocesses): the soft stop still works
            self._proc = None

    def arm(self, seconds: float, message: str) -> None:
        self._send(f"arm {seconds:.3f} {message}")

    def disarm(self) -> None:
        if self._proc is not None and self._owner == os.getpid():
            self._send("disarm")


_WATCHDOG = _Watchdog()
