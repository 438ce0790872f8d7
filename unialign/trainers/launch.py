"""How a run meets its launcher and its signals.

* ``check_launch``: launches that would train wrongly are refused.
* ``StopSignals``: while inside, SIGTERM / SIGINT are requests to stop at the next safe point (the loop finishes its
  step and saves; the final save finishes); a second one stops at once, after one line saying what is not written.
* ``watch_launcher``: a process started by ``accelerate launch`` asks the kernel for ``LAUNCHER_GONE`` when the
  launcher exits (``prctl(PR_SET_PDEATHSIG)``): a launcher killed outright (``kill -9``, an OOM kill, an older
  accelerate that exits on SIGTERM without stopping its child) is then a stop request like SIGTERM, not a run that
  trains on, orphaned, holding its directory's lock. Its piped stderr, whose reader is gone, is sent to a file
  (``<output_dir>/after_launcher_exit.log``) so that writing a progress bar cannot kill the run before it saves.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any


def check_launch(acc: Any) -> None:
    """Refuse launches that would train wrongly without an error of their own:

    * launched as N processes (``WORLD_SIZE``) while accelerate sees fewer: on a machine without CUDA,
      ``torchrun`` alone makes accelerate run every process as its own 1-process job, each training alone;
    * DeepSpeed (``configs/accelerate/zero*.yaml``): accelerate steps a DeepSpeed optimizer inside every
      ``backward`` at a sync point and clips by its own config, which this trainer's micro-batch
      accumulation, loss normaliser and non-finite guard do not drive yet (found on CPU with DeepSpeed
      0.19: the optimizer stepped after each micro-batch). Use FSDP2 (``configs/accelerate/fsdp.yaml``),
      tested against the 1-process update in ``tests/trainers/test_fsdp.py``."""
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and acc.num_processes != launched:
        raise RuntimeError(
            f"launched as {launched} processes (WORLD_SIZE) but accelerate sees {acc.num_processes}: on a machine "
            "without CUDA set ACCELERATE_USE_CPU=true or use `accelerate launch --cpu`; otherwise every process "
            "would train alone on its own copy")
    if getattr(acc.state, "deepspeed_plugin", None) is not None:
        raise RuntimeError("DeepSpeed (ZeRO) is not supported by unialign's trainers yet: their micro-batch "
                           "accumulation and non-finite guard would be bypassed. Use FSDP2: accelerate launch "
                           "--config_file configs/accelerate/fsdp.yaml ...")




# the signal the kernel sends when the launcher exits (real-time: never sent by anything else we know of; the reward
# deadline uses SIGRTMIN + 13)
LAUNCHER_GONE = signal.SIGRTMIN + 14 if hasattr(signal, "SIGRTMIN") else None
_ACTIVE: list[StopSignals] = []  # the innermost StopSignals context of the main thread, if any
_watching: dict[str, Any] = {}


class StopSignals:
    """While inside: SIGTERM, SIGINT and ``LAUNCHER_GONE`` are noted (``received``: the signal's number, 0 before
    one) instead of ending the process, so the caller can get to a safe point (``doing`` says what happens then);
    a second SIGTERM / SIGINT prints ``second`` (what is lost) and stops at once (the previous handlers apply).
    ``log_dir``: where stderr goes if the launcher exits. Installed only in the main thread (elsewhere
    ``received`` stays 0)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, doing: str = "finishing this step, then saving a checkpoint", second: str = "",
                 log_dir: str | Path | None = None) -> None:
        self.received = 0
        self.doing, self.second, self.log_dir = doing, second, log_dir
        self._previous: dict[int, Any] = {}

    def _note(self, signum: int, frame: Any) -> None:
        if self.received and signum != LAUNCHER_GONE:
            # the second signal: stop now, as if nothing were installed
            print(f"\n{signal.Signals(signum).name} again: stopping now{'; ' + self.second if self.second else ''}",
                  file=sys.stderr, flush=True)
            self._restore()
            signal.raise_signal(signum)
            return
        if signum == LAUNCHER_GONE:
            _detach_stderr(self.log_dir)
        if self.received:
            return  # already stopping: the launcher exiting (or a signal after it) asks for nothing more
        self.received = signal.SIGTERM if signum == LAUNCHER_GONE else signum
        why = "the launcher exited" if signum == LAUNCHER_GONE else f"{signal.Signals(signum).name} received"
        print(f"\n{why}: {self.doing} (send SIGTERM again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
            _ACTIVE.append(self)
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def __exit__(self, *exc: Any) -> None:
        self._restore()


def is_accelerate_launcher(pid: int) -> bool:
    """Whether process ``pid`` runs ``accelerate launch`` (its command line: an ``accelerate`` program or module,
    then ``launch``)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    names = [Path(a.decode(errors="replace")).name for a in argv]
    for k, name in enumerate(names[:-1]):  # `accelerate launch`, `python -m accelerate.commands.accelerate_cli launch`
        if (name == "accelerate" or name.startswith("accelerate.commands")) and names[k + 1] == "launch":
            return True
    return "accelerate.commands.launch" in names  # python -m accelerate.commands.launch


def watch_launcher() -> bool:
    """When this process's parent is ``accelerate launch``: ask the kernel to send ``LAUNCHER_GONE`` when it exits
    (Linux' ``prctl(PR_SET_PDEATHSIG)``), handled as a stop request inside ``StopSignals`` and as a stop with one
    line outside. Idempotent; False where it does not apply (another parent, another OS)."""
    if "parent" in _watching:
        return _watching["parent"] is not None
    parent = os.getppid()
    _watching["parent"] = None
    if LAUNCHER_GONE is None or not sys.platform.startswith("linux") or not is_accelerate_launcher(parent):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    import ctypes

    signal.signal(LAUNCHER_GONE, _launcher_gone)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(LAUNCHER_GONE), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        return False
    _watching["parent"] = parent
    if os.getppid() != parent:  # it exited before the request took effect
        os.kill(os.getpid(), LAUNCHER_GONE)
    return True


def _launcher_gone(signum: int, frame: Any) -> None:
    if _ACTIVE:
        _ACTIVE[-1]._note(signum, frame)
        return
    _detach_stderr(None)
    print("the launcher exited: stopping (no training step had started, so there is nothing to save)",
          file=sys.stderr, flush=True)
    raise SystemExit(128 + signal.SIGTERM)


def _detach_stderr(log_dir: str | Path | None) -> None:
    """Point a piped stderr whose reader (the launcher) is gone at ``<log_dir>/after_launcher_exit.log`` (or
    /dev/null), so that writing to it cannot raise ``BrokenPipeError`` before the run has saved."""
    import stat

    try:
        if not stat.S_ISFIFO(os.fstat(2).st_mode):
            return
        target = os.devnull
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            target = str(Path(log_dir) / "after_launcher_exit.log")
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    except OSError:
        pass
