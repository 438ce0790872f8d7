"""A run owns its output directory: one live run per directory (a lock file), a record of which run the
directory belongs to (``run.json``), and a refusal to start afresh over another run's outputs.

    <output_dir>/run.json        {"run_id", "created", "host", "pid"}: the run the directory belongs to; every
                                 checkpoint's trainer_state.json carries the same ``run_id``
    <output_dir>/.unialign.lock  {"pid", "host", "start_time", "run_id"} while a run is live; a lock whose
                                 process is gone (same host, pid not running or reused) is stale and replaced

The rules (``check``, at parse time, reads only; ``claim``, when the trainer starts, takes the lock):

* a fresh run (no ``--resume_from_checkpoint``) into a directory that holds another run's outputs (a
  ``checkpoint-<N>`` folder with a trainer state, ``final/`` or ``summary.json``) is refused, unless
  ``--overwrite_output_dir``: then those outputs are moved into ``replaced-<old run id>/`` (nothing is deleted)
  and the new run starts in a clean directory; tracker logs are per run either way (``logs/<run_id>/``);
* a folder named like a checkpoint that no run wrote (``checkpoint-7/`` without a trainer state) is refused at
  the start of a fresh run: a checkpoint would have to replace it; a checkpoint is never written over a folder
  this run did not write (``save_checkpoint``), and rotation deletes only this run's own checkpoints;
* a resume continues the checkpoint's run (its ``run_id``);
* a second live run on the same directory is refused, naming the pid and host holding it.

Only the main process (``RANK`` 0, or a single process) takes the lock and writes ``run.json``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from unialign.errors import UserError
from unialign.files import DiskFullError, disk_full, full_message, is_partial, refuse_link, write_json

RUN_FILE = "run.json"
LOCK_FILE = ".unialign.lock"
RUN_ID = re.compile(r"[0-9a-f]{16}")  # a run id names folders (logs/<id>, replaced-<id>): nothing else is one


CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
STATE_FILE = "trainer_state.json"  # the loop's own state: plain JSON, never a pickle
LEGACY_STATE_FILE = "trainer_state.pt"  # older checkpoints; read with torch.load(weights_only=True) only


def checkpoint_step(path: Path) -> int | None:
    """The step in a ``checkpoint-<N>`` folder name (digits only), else None: ``checkpoint-v2`` is not a checkpoint."""
    m = CHECKPOINT_RE.fullmatch(path.name)
    return int(m.group(1)) if m else None


def state_file(ckpt: Path) -> Path | None:
    """The trainer-state file of checkpoint folder ``ckpt`` (JSON, or an older checkpoint's .pt), or None."""
    for name in (STATE_FILE, LEGACY_STATE_FILE):
        if (ckpt / name).is_file():
            return ckpt / name
    return None


def run_id_of(ckpt: Path) -> str | None:
    """The run id a checkpoint's trainer state records (None for older checkpoints or an unreadable state)."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return state.get("run_id") if isinstance(state, dict) else None


def list_checkpoints(output_dir: str | Path, run_id: str | None = None, legacy: bool = False) -> list[Path]:
    """The checkpoints directly under ``output_dir``, oldest first: folders named ``checkpoint-<digits>`` that hold a
    trainer state (anything else that merely resembles one is ignored: never parsed, never deleted). With
    ``run_id``, only those that run wrote (its id in their trainer state), and with ``legacy`` also those from
    before run ids (no id)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = sorted(((checkpoint_step(p), p) for p in out.iterdir() if p.is_dir() and not p.is_symlink()
                    and checkpoint_step(p) is not None and state_file(p) is not None), key=lambda sp: sp[0])
    return [p for _, p in found if run_id is None or run_id_of(p) == run_id or (legacy and run_id_of(p) is None)]


@dataclass
class RunClaim:
    """The run that holds ``output_dir`` in this process: its id (None on processes other than the main one)."""

    output_dir: Path
    run_id: str | None
    locked: bool = False
    legacy: bool = False  # resumed a checkpoint without a run id: such checkpoints count as this run's


def claimed(output_dir: str | Path) -> RunClaim | None:
    """This process's claim on ``output_dir``, if it holds one."""
    return _CLAIMS.get(Path(output_dir).resolve())


_CLAIMS: dict[Path, RunClaim] = {}  # directories this process holds, by resolved path


def is_main_launch_rank() -> bool:
    """True on the process that owns files (``RANK`` 0 or unset), known before any process group exists."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def read_run_file(output_dir: str | Path) -> dict | None:
    """``run.json`` of ``output_dir`` as a dict, or None when absent or unreadable (a damaged file is ignored:
    the directory then counts as a directory of unknown runs)."""
    try:
        data = json.loads((Path(output_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("run_id"), str) and RUN_ID.fullmatch(data["run_id"])
    return data if ok else None


def run_outputs(output_dir: str | Path) -> list[str]:
    """What in ``output_dir`` shows that a run trained there: its checkpoints (``checkpoint-<N>`` folders holding a
    trainer state), ``final/`` and ``summary.json`` (names, sorted)."""
    out = Path(output_dir)
    found = [p.name for p in list_checkpoints(out)]
    found += [name for name in ("final", "summary.json") if (out / name).exists()]
    return found


def check(output_dir: str | Path, resuming: bool, overwrite: bool) -> None:
    """The read-only half of ``claim``, run at parse time before any model loads: an empty name, a directory
    another live run holds, or a fresh run over another run's outputs is a ``UserError``."""
    if not str(output_dir).strip():
        raise UserError("--output_dir: empty; name a folder for this run's outputs (an empty name would write into "
                        "the current directory)")
    out = Path(output_dir)
    check_links(out)
    mine = out.resolve() in _CLAIMS or not is_main_launch_rank()  # the other processes of a launch share rank 0's lock
    holder = None if mine else _live_holder(out / LOCK_FILE)
    if holder is not None:
        raise UserError(_held_message(out, holder))
    if resuming:
        return
    outputs = run_outputs(out)
    if outputs and not overwrite:
        shown = ", ".join(outputs[:4]) + (f" and {len(outputs) - 4} more" if len(outputs) > 4 else "")
        raise UserError(f"--output_dir: {str(out)!r} holds another run's outputs ({shown}); pass "
                        "--resume_from_checkpoint latest to continue that run, --overwrite_output_dir to start "
                        "afresh there (that run's outputs are moved into a replaced-<run id>/ folder), or choose "
                        "another --output_dir")
    lookalikes = sorted(p.name for p in _entries(out) if p.is_dir() and checkpoint_step(p) is not None
                        and p.name not in outputs)
    if lookalikes:
        raise UserError(f"--output_dir: {str(out)!r} has folders named like this run's checkpoints that no run "
                        f"wrote ({', '.join(lookalikes[:4])}); a checkpoint would have to replace them: move them "
                        "away or choose another --output_dir")


def claim(output_dir: str | Path, resuming: bool, overwrite: bool, run_id: str | None = None) -> RunClaim:
    """Take ``output_dir`` for this process's run (idempotent within a process): ``check`` it, take the lock and,
    on the main process, write ``run.json`` for ``run_id`` (a resume passes its checkpoint's id; None: a new id).
    The lock is released by ``release`` or at exit."""
    out = Path(output_dir)
    key = out.resolve()
    if key in _CLAIMS:
        return _CLAIMS[key]
    check(out, resuming, overwrite)
    if not is_main_launch_rank():
        _CLAIMS[key] = RunClaim(out, None)
        return _CLAIMS[key]
    out.mkdir(parents=True, exist_ok=True)
    legacy = resuming and run_id is None  # resuming a checkpoint from before run ids: its folder-mates are this run's
    run_id = run_id or uuid.uuid4().hex[:16]
    _take_lock(out, run_id)
    try:
        remove_debris(out, run_id)
        previous = read_run_file(out)
        if overwrite and not resuming:
            _set_aside(out, previous["run_id"] if previous else None)
        if previous is None or previous.get("run_id") != run_id:
            record = {"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "host": socket.gethostname(), "pid": os.getpid()}
            if previous is not None:
                record["replaces_run"] = previous["run_id"]
            write_json(out / RUN_FILE, record, f"the run record {out / RUN_FILE}", indent=1)
    except BaseException:
        _drop_lock(out / LOCK_FILE)
        raise
    _CLAIMS[key] = RunClaim(out, run_id, locked=True, legacy=legacy)
    return _CLAIMS[key]


def owner_run_id(output_dir: str | Path) -> str | None:
    """The run ``output_dir`` belongs to: this process's claim, else ``run.json``'s, else None (a directory from
    before run ids were recorded)."""
    held = _CLAIMS.get(Path(output_dir).resolve())
    if held is not None and held.run_id is not None:
        return held.run_id
    record = read_run_file(output_dir)
    return record["run_id"] if record else None


def release(output_dir: str | Path) -> None:
    """End this process's claim on ``output_dir``: its lock file is removed (only if it is still this process's)."""
    held = _CLAIMS.pop(Path(output_dir).resolve(), None)
    if held is not None and held.locked:
        _drop_lock(held.output_dir / LOCK_FILE)


@atexit.register
def _release_all() -> None:
    for key in list(_CLAIMS):
        release(key)


def _entries(out: Path) -> list[Path]:
    try:
        return list(out.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _set_aside(out: Path, previous_id: str | None) -> None:
    """``--overwrite_output_dir``: move the previous run's outputs (checkpoints, ``final/``, ``summary.json``, its
    ``completions.jsonl`` and ``comparison.png``, the temporary files its writes left) into
    ``replaced-<its run id>/`` so nothing is lost and nothing is mixed; say what moved. Nothing else moves: a
    person's ``.tmp-final/`` or ``final.old/`` stays where it is."""
    moving = run_outputs(out) + [p.name for p in _entries(out) if is_partial(p.name)]
    if moving:
        moving += [name for name in ("completions.jsonl", "comparison.png") if (out / name).exists()]
    if not moving:
        return
    target = out / f"replaced-{previous_id or time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while target.exists():
        target, n = target.with_name(f"{target.name.split('.')[0]}.{n}"), n + 1
    target.mkdir()
    for name in moving:
        os.replace(out / name, target / name)
    print(f"--overwrite_output_dir: the previous run's outputs ({', '.join(sorted(moving))}) were moved to {target}",
          file=sys.stderr)


# ------------------------------------------------------------------ the lock
# The lock is the kernel's: ``flock(LOCK_EX)`` on ``.unialign.lock``, held by an open descriptor for the life of
# the run and dropped by the kernel when the process ends however it ends, so "stale" needs no guessing and two
# contenders can never both hold it (the file's JSON only says who holds it). A descriptor whose file was replaced
# between open and flock is dropped and the open retried.
_HELD: dict[Path, int] = {}  # lock path -> the descriptor holding it


def _try_flock(fd: int, path: Path) -> bool:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:  # ENOLCK / EOPNOTSUPP: a file system without locks
        raise UserError(f"--output_dir: {str(path.parent)!r}: the file system cannot lock {LOCK_FILE} "
                        f"({err.strerror}); choose an --output_dir on a local disk or one with locking") from None
    return True


def _read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {"damaged": True}
    return data if isinstance(data, dict) else {"damaged": True}


def _live_holder(path: Path) -> dict | None:
    """Who holds the lock at ``path`` when another process does (its JSON, or ``{"pid": "?"}`` while it is being
    written), else None (no lock file, or nobody holds it)."""
    if path in _HELD or path.is_symlink():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        free = _try_flock(fd, path)
    finally:
        os.close(fd)  # closing drops a flock this descriptor took
    data = _read_lock(path) or {}
    if free and not _other_host(data):
        return None
    return {"pid": "?", "host": "?", **{k: v for k, v in data.items() if k != "damaged"}}


def _other_host(data: dict) -> bool:
    """A lock written on another machine: whether that run lives cannot be told from here (a file system whose
    locks are local to each machine would let both take it), so it holds until someone removes it."""
    return isinstance(data.get("host"), str) and data["host"] != socket.gethostname()


def _held_message(out: Path, holder: dict) -> str:
    where = f"pid {holder.get('pid')} on host {holder.get('host')}"
    hint = ("; if that run is gone (another machine's process cannot be checked from here), delete "
            f"{out / LOCK_FILE}" if _other_host(holder) else "")
    return f"--output_dir: {str(out)!r} is in use by another live run ({where}, lock {LOCK_FILE}){hint}"


def _take_lock(out: Path, run_id: str) -> None:
    path = out / LOCK_FILE
    refuse_link(path, LOCK_FILE)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start_time": _process_start(os.getpid()),
          "run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            kind = disk_full(err, path)
            if kind:
                raise DiskFullError(full_message(kind, f"the lock {path}", path)) from None
            raise
        if not _try_flock(fd, path):
            os.close(fd)
            raise UserError(_held_message(out, _live_holder(path) or {"pid": "?", "host": "?"}))
        data = _read_lock(path) or {}
        if _other_host(data):
            os.close(fd)
            raise UserError(_held_message(out, data))
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the holder we waited on removed the file as it released it: take the new one
            os.close(fd)
            continue
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(me).encode())
        except OSError as err:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            kind = disk_full(err, path)
            if kind:
                raise DiskFullError(full_message(kind, f"the lock {path}", path)) from None
            raise
        _HELD[path] = fd
        return
    raise UserError(f"--output_dir: {str(out)!r}: could not take {LOCK_FILE} (another run keeps taking it)")


def _drop_lock(path: Path) -> None:
    fd = _HELD.pop(path, None)
    if fd is None:
        return
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
            path.unlink()  # while still holding it: a contender that opened it sees another file and retries
    os.close(fd)


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat), or None where
    /proc is unavailable (recorded in the lock for people reading it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# ------------------------------------------------------------------ links and debris
# what a run writes directly under its output directory: none of these may be a symbolic link
OWN_NAMES = (RUN_FILE, LOCK_FILE, "final", "summary.json", "completions.jsonl", "logs", "comparison.png",
             "reward_curve.png", "loss_curve.png")


def check_links(out: Path) -> None:
    """Refuse, with one line, an output directory that is a dangling or looping link, and any link among the
    files and folders a run replaces or deletes in it (``OWN_NAMES``, ``checkpoint-<N>``): a link is never
    written through or deleted with what it points to. A link elsewhere on the path (``outputs -> /big/disk``)
    is followed as usual: nothing there is replaced or deleted."""
    for part in (out, *out.parents):  # the folder itself, or a folder on its path, as a broken link
        if part.is_symlink() and not part.exists():
            try:
                target = os.readlink(part)
            except OSError:
                target = "?"
            try:
                part.stat()
                why = "points to nothing"
            except OSError as err:
                why = "loops" if err.errno == errno.ELOOP else "points to nothing"
            name = repr(str(out)) if part == out else f"{str(out)!r}: {part}"
            raise UserError(f"--output_dir: {name} is a symbolic link that {why} (-> {target}); make its target "
                            "a folder or choose another --output_dir")
    for p in _entries(out):
        if p.is_symlink() and (p.name in OWN_NAMES or checkpoint_step(p) is not None):
            try:
                target = os.readlink(p)
            except OSError:
                target = "?"
            raise UserError(f"--output_dir: {p} is a symbolic link (-> {target}); a run replaces {p.name} "
                            "atomically and never writes through a link or deletes what it points to: remove the "
                            "link (its target is left alone), or point --output_dir at that storage instead")


def remove_debris(out: Path, run_id: str | None) -> None:
    """Remove the temporary files and folders (``unialign.files.partial_name``) that a killed process of this
    run (``run_id``), or a process no longer alive, left in ``out``: names no person picks and no run reads.
    Called with the lock held."""
    from unialign.files import PARTIAL_RE

    for p in _entries(out):
        m = PARTIAL_RE.fullmatch(p.name)
        if m is None or p.is_symlink():
            continue
        token = m.group("token")
        mine = token == run_id if "-" not in token else not _pid_alive(int(token.split("-")[0]))
        if mine:
            with contextlib.suppress(OSError):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
