"""How a run writes files: one policy for every file and folder it leaves (checkpoints, ``final/``,
``summary.json``, curves, ``completions.jsonl``, comparison images, reference caches, ``run.json``).

* **Replaced** (a file written whole): written to a temporary file beside it under a name no person picks
  (``partial_name``: ``.<stem>.partial-<pid>-<hex><suffix>``), flushed to disk, then renamed over the old one
  (``os.replace``), so a reader sees the old file or the new one, never half of either (``write_text``,
  ``write_bytes``, ``write_json``; ``write_with`` for a writer that takes a path: PIL, matplotlib, safetensors).
* **Appended** (``completions.jsonl``): whole lines; a write that fails cuts the file back to its length before,
  so no half line stays (``append_text``).
* **Folders** (checkpoints, ``final/``): written into a temporary folder (``.<name>.partial-<token>``), flushed,
  then renamed into place; the folder they replace is first renamed aside (``.<name>.replaced-<token>``) and
  removed only after (``replace_dir``).
* **Links are never followed** to replace or delete: a symbolic link where a file or folder is replaced, or a
  tree is removed, is refused with ``LinkError`` naming it (the link and what it points to stay as they were).
* **Failures**: a write that fails removes its own temporary file or folder (never anything else); a full disk
  or an exceeded quota (ENOSPC / EDQUOT) becomes ``DiskFullError``: one line naming what was written, the error
  and the space left. Nothing here deletes a name it did not create.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import numbers
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from unialign.errors import UserError

PARTIAL_RE = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|replaced)-(?P<token>[0-9a-f]{16}|\d+-[0-9a-f]{8})"
                        r"(?P<suffix>\.[A-Za-z0-9]+)?")
FULL_ERRNOS = {errno.ENOSPC: "disk full (ENOSPC)", errno.EDQUOT: "disk quota exceeded (EDQUOT)"}


class DiskFullError(UserError):
    """A write ran out of space (ENOSPC) or quota (EDQUOT); the message names what was written and the space
    left, and says that the partial copy is gone."""


class LinkError(UserError):
    """A file or folder the run would replace or delete is a symbolic link; nothing was changed."""


# ------------------------------------------------------------------ names
def _token() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def partial_name(path: str | Path, token: str | None = None, kind: str = "partial") -> Path:
    """A temporary name beside ``path`` that no person picks: ``.<stem>.partial-<token><suffix>`` (the suffix kept,
    so writers that read the format from the name still do). ``token``: a run id (16 hex digits; every process of
    a launch agrees on it) or, by default, ``<pid>-<8 hex>``."""
    path = Path(path)
    suffix = path.suffix if re.fullmatch(r"\.[A-Za-z0-9]+", path.suffix) else ""
    stem = path.name[:-len(suffix)] if suffix else path.name
    return path.with_name(f".{stem}.{kind}-{token or _token()}{suffix}")


def is_partial(name: str, token: str | None = None) -> bool:
    """Whether ``name`` is one of this module's temporary names (of ``token`` only, when given)."""
    m = PARTIAL_RE.fullmatch(name)
    return m is not None and (token is None or m.group("token") == token)


# ------------------------------------------------------------------ errors
def disk_full(err: BaseException, path: Path | None = None) -> str | None:
    """``"disk full (ENOSPC)"`` / ``"disk quota exceeded (EDQUOT)"`` when ``err`` (or what caused it) is that
    error, or torch's serializer failed the way a full disk makes it fail (``unexpected pos``, ``file write
    failed``) while ``path``'s file system has almost nothing left; else None."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return FULL_ERRNOS[seen.errno]
        seen = seen.__cause__ or seen.__context__
    text = str(err)
    if path is not None and any(s in text for s in ("No space left", "unexpected pos", "file write failed",
                                                    "Disk quota exceeded")):
        return FULL_ERRNOS[errno.ENOSPC] if free_bytes(path) < 64 * 2**20 else None
    return None


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            if p.exists():
                return shutil.disk_usage(p).free
    return 0


def full_message(kind: str, what: str, where: Path) -> str:
    free = free_bytes(where)
    return (f"{kind} while writing {what} ({free / 2**20:.1f} MiB free on that file system); the partial copy was "
            "removed and the previous checkpoints are intact: free some space, then --resume_from_checkpoint latest")


def _remove_own(tmp: Path) -> None:
    """Remove a temporary file or folder this module made (never a link's target)."""
    with contextlib.suppress(OSError):
        if tmp.is_symlink() or not tmp.is_dir():
            tmp.unlink(missing_ok=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def writing(tmp: Path | None, what: str) -> Iterator[None]:
    """Around writing ``what`` (through the temporary path ``tmp``, when there is one): on any failure ``tmp`` is
    removed, so a partial write never holds the space, and a full disk is re-raised as ``DiskFullError``."""
    try:
        yield
    except BaseException as err:
        kind = disk_full(err, tmp if tmp is not None else Path("."))
        if tmp is not None:
            _remove_own(tmp)
        if kind and not isinstance(err, DiskFullError):
            raise DiskFullError(full_message(kind, what, tmp if tmp is not None else Path("."))) from None
        raise


def refuse_link(path: Path, what: str) -> None:
    """``LinkError`` when ``path`` is a symbolic link (dangling or looping ones too)."""
    if path.is_symlink():
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise LinkError(f"{path}: is a symbolic link (-> {target}); {what} is replaced atomically and a link is never "
                        "written through or deleted with what it points to: remove the link (its target is left "
                        "alone) or choose another --output_dir")


# ------------------------------------------------------------------ files
def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_tree(root: Path) -> None:
    """Flush every file of ``root`` to disk before it is renamed into place (a power loss must not leave a
    checkpoint whose files are named but empty)."""
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fsync_file(path)


def write_with(path: str | Path, writer: Callable[[Path], Any], what: str | None = None) -> Path:
    """Replace ``path`` by what ``writer(tmp)`` writes to a temporary path beside it (same suffix), flushed and
    renamed into place; parents are created. Returns ``path``."""
    path = Path(path)
    what = what or str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    refuse_link(path, what)
    tmp = partial_name(path)
    with writing(tmp, what):
        writer(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    return path


def write_bytes(path: str | Path, data: bytes, what: str | None = None) -> Path:
    """``write_with`` of ``data``."""
    return write_with(path, lambda tmp: tmp.write_bytes(data), what)


def write_text(path: str | Path, text: str, what: str | None = None) -> Path:
    """``write_with`` of ``text`` (UTF-8)."""
    return write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), what)


def json_safe(obj: Any) -> Any:
    """``obj`` as strict JSON data: NaN / +-inf -> None, numpy and one-element tensor scalars -> numbers,
    tuples -> lists, paths and other objects -> ``str``; dict keys become strings."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if hasattr(obj, "numel") and hasattr(obj, "item") and callable(obj.numel) and obj.numel() == 1:  # a tensor
        obj = obj.item()
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if type(obj).__module__.startswith("PIL.") and hasattr(obj, "size"):  # an image in a prompt: its size, not a repr
        return f"<image {obj.size[0]}x{obj.size[1]}>"
    return str(obj)


def write_json(path: str | Path, data: Any, what: str | None = None, indent: int | None = 2) -> Path:
    """``data`` as strict JSON (``json_safe``: NaN / Infinity become null), replaced atomically."""
    return write_text(path, json.dumps(json_safe(data), indent=indent, allow_nan=False), what)


def append_text(path: str | Path, text: str, what: str | None = None) -> None:
    """Append ``text`` (whole lines) to ``path`` and flush it to disk; if the write fails, the file is cut back to
    its length before (no half line stays) and a full disk is ``DiskFullError``."""
    path = Path(path)
    what = what or str(path)
    refuse_link(path, what)
    data = text.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            kind = disk_full(err, path)
            if kind:
                raise DiskFullError(full_message(kind, what, path)) from None
            raise
    finally:
        os.close(fd)


# ------------------------------------------------------------------ folders
def umask_modes(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open`` would (0666 less the umask): some writers (safetensors
    via transformers' ``save_pretrained``) create their files 0600, which another user or a container then cannot
    read."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~mask)


def temp_dir(final_dir: str | Path, token: str | None = None) -> Path:
    """A new empty temporary folder beside ``final_dir`` (``partial_name``). With a ``token`` (a run id: the same
    name on every process of a launch), a folder of that name left by a killed save of the same run is removed
    first; without one the name is new."""
    tmp = partial_name(final_dir, token)
    if token is not None and tmp.exists() and not tmp.is_symlink():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True, exist_ok=token is not None)
    return tmp


def replace_dir(tmp_dir: Path, final_dir: Path, what: str | None = None) -> None:
    """Move a fully written ``tmp_dir`` to ``final_dir`` so that a crash never leaves a half folder: a folder
    already there is renamed aside (``.<name>.replaced-<pid>-<hex>``) first and deleted only after the rename.
    ``LinkError`` (nothing moved) when ``final_dir`` is a symbolic link."""
    refuse_link(final_dir, what or f"{final_dir.name}/")
    if final_dir.exists():
        aside = partial_name(final_dir, kind="replaced")
        os.replace(final_dir, aside)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)


def remove_tree(path: Path, what: str | None = None) -> None:
    """Delete the folder ``path`` (``LinkError`` for a link: neither it nor its target is touched)."""
    refuse_link(path, what or str(path))
    shutil.rmtree(path)
