"""Rows of a dataset from a Hugging Face Hub id, a local file or a local folder, and the held-out split.

``load_dataset_rows(name, split)`` gives a list of dicts from

* a local ``.jsonl`` / ``.json`` / ``.parquet`` file (the whole file, whatever ``split`` says). JSON lines
  are read one line at a time (memory: the rows kept), so that a bad line is reported with its number
  as soon as it is read; a ``.json`` file (read whole) may hold a list of objects, a mapping of
  equal-length columns, or JSON lines; parquet is read a record batch at a time;
* a local folder: the split's files found by name as ``datasets.load_dataset(folder)`` does
  (``train.jsonl``, ``test-00000-of-00001.parquet``, ``data/validation.json``, a ``train/`` folder, ...;
  ``SPLIT_KEYWORDS`` lists the accepted spellings); a folder whose files name no split is all ``train``;
* a Hub id (``datasets.load_dataset(name, config, split=split)``; fails at once, clearly, offline), or with
  ``streaming=True`` the first ``limit`` rows of ``datasets.load_dataset(..., streaming=True)`` (nothing else
  is downloaded).

Text must be UTF-8: an undecodable byte is an error naming ``file:line`` unless ``encoding_errors="replace"``
(U+FFFD for each bad byte, as ``bytes.decode(errors="replace")``). A value nested deeper than ``MAX_DEPTH``
levels is refused by file and line (Python's recursive JSON parser and everything after it would fail on it).

Rows missing a column that others have get ``None`` there, as ``datasets`` does. ``train_eval_rows``
resolves the training rows and the held-out rows: a separate eval dataset, an eval split, or -- for a
single local file, or a folder without an eval split -- a fraction split off the training rows with a
fixed seed, so that evaluation never sees a training row. Every problem is a ``UserError`` (one line,
exit 2 in the scripts) naming the file, and the line or row.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from unialign.config import UserError
from unialign.hub import HubUnavailableError, require_hub

SUFFIXES = (".jsonl", ".json", ".parquet")
SPLIT_KEYWORDS = {  # datasets.data_files.SPLIT_KEYWORDS
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
SPLIT_SEED = 0  # the held-out fraction is the same for every training seed
ENCODING_ERRORS = ("strict", "replace")
MAX_DEPTH = 100  # nesting of lists / objects in one row (conversations with content parts need 4)
BOM = b"\xef\xbb\xbf"


def is_local(name: str) -> bool:
    """Whether ``name`` names a local file or folder (an existing path, or a path with a data suffix)."""
    return Path(name).expanduser().exists() or Path(name).suffix in SUFFIXES


# ------------------------------------------------------------------ files
def read_file(path: str | Path, *, encoding_errors: str = "strict", limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of one .jsonl / .json / .parquet file (``UserError`` naming the file, line or row); with
    ``limit``, only the first ``limit`` rows (a .jsonl or .parquet file is read no further)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"dataset file {str(path)!r} does not exist")
    if path.suffix not in SUFFIXES:
        raise UserError(f"dataset file {str(path)!r}: unsupported type {path.suffix!r}; use {', '.join(SUFFIXES)}")
    if encoding_errors not in ENCODING_ERRORS:
        raise UserError(f"--encoding_errors: {encoding_errors!r} is not one of {', '.join(ENCODING_ERRORS)}")
    if path.suffix == ".parquet":
        rows = list(itertools.islice(_read_parquet(path), limit))
    elif path.suffix == ".jsonl":
        with path.open("rb") as f:
            rows = list(itertools.islice(_json_lines(path, f, encoding_errors), limit))
    else:
        rows = _read_json(path, path.read_bytes(), encoding_errors)[:limit]
    if not rows:
        raise UserError(f"dataset file {str(path)!r} has no rows")
    return _fill_columns(rows)


def decode_text(path: Path, data: bytes, errors: str, lineno: int | None = None) -> str:
    """``data`` as UTF-8; a bad byte is a ``UserError`` naming ``path:line`` (the line found from the offset
    when ``lineno`` is None) unless ``errors == "replace"``."""
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as err:
        if lineno is None:
            lineno = data.count(b"\n", 0, err.start) + 1
            column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        else:
            column = err.start + 1
        raise UserError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{data[err.start]:02x} at byte {column} of the "
                        "line); fix the file's encoding, or pass --encoding_errors replace to read such bytes as "
                        "U+FFFD") from None


def _json_lines(path: Path, lines: Iterable[bytes | str], errors: str = "strict") -> Iterator[dict[str, Any]]:
    """The objects of JSON lines (``lines``: bytes, decoded here, or text), one line at a time; blank lines skipped."""
    for lineno, line in enumerate(lines, start=1):
        if isinstance(line, bytes):
            if lineno == 1 and line.startswith(BOM):
                line = line[len(BOM):]
            line = decode_text(path, line, errors, lineno)
        elif lineno == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        row = _parse(path, line, lineno)
        if not isinstance(row, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        yield row


def _parse(path: Path, text: str, lineno: int) -> Any:
    """One JSON line, its errors named ``path:lineno``; nesting beyond ``MAX_DEPTH`` refused."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise UserError(f"{path}:{lineno}: JSON nested too deeply (more than {MAX_DEPTH} levels are refused)") from None
    _check_depth(f"{path}:{lineno}", text, [value])
    return value


def _check_depth(where: str, text: str, values: list[Any]) -> None:
    """Refuse a value nested more than ``MAX_DEPTH`` levels (measured only when ``text`` has that many brackets)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    for i, value in enumerate(values):
        if depth(value, MAX_DEPTH) > MAX_DEPTH:
            at = f"{where}: row {i}" if len(values) > 1 else where
            raise UserError(f"{at}: JSON nested more than {MAX_DEPTH} levels deep")


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of lists / tuples / dicts in ``value`` (0 for a scalar), counted without recursion and
    stopping once it exceeds ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, (list, tuple)):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((child, d + 1) for child in node if isinstance(child, (list, tuple, dict)))
    return deepest


def _read_json(path: Path, data: bytes, errors: str = "strict") -> list[dict[str, Any]]:
    text = decode_text(path, data[len(BOM):] if data.startswith(BOM) else data, errors)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.lineno > 1:  # JSON lines in a .json file (datasets reads those too)
            return list(_json_lines(path, text.split("\n")))
        raise UserError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply (more than {MAX_DEPTH} levels are refused)") from None
    _check_depth(str(path), text, data if isinstance(data, list) else [data])
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list) \
            and all(isinstance(r, dict) for r in next(iter(data.values()))):
        data = next(iter(data.values()))  # {"data": [{...}, ...]}
    if isinstance(data, dict):  # columns: {"prompt": [...], "answer": [...]}
        lengths = {k: len(v) if isinstance(v, list) else -1 for k, v in data.items()}
        if not data or min(lengths.values()) < 0 or len(set(lengths.values())) != 1:
            raise UserError(f"{path}: a JSON object must map column names to lists of equal length ({lengths})")
        n = next(iter(lengths.values()))
        return [{k: v[i] for k, v in data.items()} for i in range(n)]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of objects, got {type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise UserError(f"{path}: row {i}: expected a JSON object, got {type(row).__name__}")
    return data


def _read_parquet(path: Path, batch_rows: int = 128) -> Iterator[dict[str, Any]]:
    """The rows of a parquet file, read ``batch_rows`` at a time (memory: the rows kept and one batch)."""
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as f:
            for batch in f.iter_batches(batch_size=batch_rows):
                yield from batch.to_pylist()
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise UserError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None


def _fill_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return [r if len(r) == len(columns) else {k: r.get(k) for k in columns} for r in rows]


# ------------------------------------------------------------------ folders
def split_files(folder: str | Path) -> dict[str, list[Path]]:
    """Data files of ``folder`` by split, found by name like ``datasets.load_dataset(folder)``: a file or
    sub-folder whose name is, or starts or ends (around ``-._``, space or digits) with, a keyword of
    ``SPLIT_KEYWORDS`` (``train.jsonl``, ``test-00000-of-00001.parquet``, ``dev.json``, ``valid/a.jsonl``).
    When no name holds a keyword, every file is ``train``."""
    folder = Path(folder).expanduser()
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    out: dict[str, list[Path]] = {}
    for p in files:
        split = _split_of(p.relative_to(folder))
        if split:
            out.setdefault(split, []).append(p)
    if not out and files:
        out["train"] = files
    return out


def _split_of(relative: Path) -> str | None:
    sep = r"[-._ 0-9]"
    names = [relative.stem.lower()] + [part.lower() for part in reversed(relative.parts[:-1])]
    for name in names:  # the file name first, then its folders
        for split, keywords in SPLIT_KEYWORDS.items():
            if any(re.fullmatch(rf"(.*{sep})?{kw}({sep}.*)?", name) for kw in keywords):
                return split
    return None


# ------------------------------------------------------------------ any source
def load_dataset_rows(name: str, split: str | None, config_name: str | None = None, *,
                      encoding_errors: str = "strict", decode_images: bool = True, streaming: bool = False,
                      limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a local file (all of it), a split of a local folder, or a split of a Hub dataset; with
    ``limit``, only the first ``limit`` rows (local files are read no further). ``streaming``: a Hub dataset
    through ``datasets.load_dataset(..., streaming=True)``, reading only the rows taken (``limit``).
    ``decode_images=False`` keeps a Hub dataset's ``Image`` columns encoded (``{"bytes", "path"}`` dicts)."""
    path = Path(name).expanduser()
    if path.is_dir():
        splits = split_files(path)
        if not splits:
            raise UserError(f"dataset folder {name!r} has no .jsonl / .json / .parquet files")
        if split not in splits:
            raise UserError(f"dataset folder {name!r} has no {split!r} split; found {sorted(splits)}")
        rows: list[dict[str, Any]] = []
        for f in splits[split]:
            if limit is not None and len(rows) >= limit:
                break
            rows += read_file(f, encoding_errors=encoding_errors, limit=None if limit is None else limit - len(rows))
        return rows
    if path.suffix in SUFFIXES:
        return read_file(path, encoding_errors=encoding_errors, limit=limit)
    return _load_hub(name, split or "train", config_name, decode_images=decode_images, streaming=streaming,
                     limit=limit)


def _load_hub(name: str, split: str, config_name: str | None, *, decode_images: bool = True, streaming: bool = False,
              limit: int | None = None) -> list[dict[str, Any]]:
    import datasets

    require_hub(name, "dataset", use_cache=not streaming)  # streaming reads the Hub itself, never the cache

    def failed(err: Exception) -> UserError:
        first = str(err).splitlines()[0] if str(err) else ""
        return UserError(
            f"could not {'stream' if streaming else 'load'} dataset {name!r} (config {config_name!r}, split {split!r}): {type(err).__name__}: "
            f"{first}. Pass a local .jsonl/.json/.parquet file or folder with the same schema, or a Hub id that "
            "is reachable (and its --dataset_config).")

    try:
        ds = datasets.load_dataset(name, config_name, split=split, **({"streaming": True} if streaming else {}))
        if not decode_images:  # images stay encoded ({"bytes", "path"}) until a batch decodes them
            for column, feature in (getattr(ds, "features", None) or {}).items():
                if isinstance(feature, datasets.Image) and feature.decode:
                    ds = ds.cast_column(column, datasets.Image(decode=False))
        rows = [dict(r) for r in itertools.islice(ds, limit)]  # streaming: only these rows are fetched
    except HubUnavailableError:
        raise
    except Exception as err:  # noqa: BLE001 - hub / connection errors come in many types
        raise failed(err) from None
    if not rows:
        raise UserError(f"dataset {name!r} split {split!r} has no rows")
    return rows


def train_eval_rows(name: str, *, config_name: str | None = None, train_split: str = "train",
                    eval_split: str | None = None, eval_name: str | None = None, eval_fraction: float = 0.1,
                    seed: int = SPLIT_SEED, prepare: Callable[[list[dict], str], list[dict]] | None = None,
                    encoding_errors: str = "strict", decode_images: bool = True,
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """(training rows, held-out rows, a description of where the held-out rows came from).

    Held-out rows are, in order: ``eval_name`` (its ``eval_split``, default ``test``, when it is a folder
    or a Hub id); else ``eval_split`` of ``name``; else, for a folder, its ``test`` or ``validation``
    split; else (a single file, or a folder with only training files) ``eval_fraction`` of the training
    rows, chosen with ``seed`` and removed from training together with every copy of them (counted in
    ``info["train_duplicates_of_held_out_dropped"]``). Hub datasets default to their ``test`` split.

    ``prepare(rows, source)`` (validation / normalisation that keeps one output row per input row) runs on
    each loaded split before any row is held out, so its errors name rows as they are in the file; when
    rows are held out, ``info["row_ids"]`` maps positions in the two lists back to those rows.
    ``encoding_errors`` / ``decode_images``: as ``load_dataset_rows``.
    """
    path = Path(name).expanduser()
    single_file = not path.is_dir() and is_local(name)
    if single_file and eval_split is not None and eval_name is None:
        raise UserError(f"--eval_split {eval_split!r}: {name!r} is a single file without splits; pass the held-out "
                        "file with --eval_dataset_name, or leave --eval_split unset to hold out --eval_fraction")

    def load(source: str, split: str | None) -> list[dict[str, Any]]:
        rows = load_dataset_rows(source, split, config_name, encoding_errors=encoding_errors,
                                 decode_images=decode_images)
        whole = is_local(source) and not Path(source).expanduser().is_dir()
        return prepare(rows, source if whole else f"{source} [{split}]") if prepare else rows

    train = load(name, train_split)
    if eval_name is not None:
        whole_file = is_local(eval_name) and not Path(eval_name).expanduser().is_dir()
        return train, load(eval_name, eval_split or "test"), {
            "eval_source": eval_name if whole_file else f"{eval_name} [{eval_split or 'test'}]"}
    if path.is_dir():
        splits = split_files(path)
        candidates = [eval_split] if eval_split is not None else [s for s in ("test", "validation") if s in splits]
        if candidates:
            return train, load(name, candidates[0]), {"eval_source": f"{name} [{candidates[0]}]"}
    elif not single_file:  # a Hub id
        split = eval_split or "test"
        return train, load(name, split), {"eval_source": f"{name} [{split}]"}
    ids = list(range(len(train)))
    train_ids, eval_ids = split_off(ids, eval_fraction, seed, name)
    held = {row_key(train[i]) for i in eval_ids}  # a duplicate of a held-out row must not train either
    kept = [i for i in train_ids if row_key(train[i]) not in held]
    info = {"eval_source": f"{eval_fraction:g} of {name} held out (seed {seed})", "eval_fraction": eval_fraction,
            "eval_split_seed": seed, "row_ids": {"train": kept, "eval": eval_ids}}
    if len(kept) < len(train_ids):
        info["train_duplicates_of_held_out_dropped"] = len(train_ids) - len(kept)
    if not kept:
        raise UserError(f"{name}: every training row is a copy of a held-out row; pass --eval_dataset_name")
    return [train[i] for i in kept], [train[i] for i in eval_ids], info


def streamed_train_eval_rows(name: str, *, train_rows: int, eval_rows: int, config_name: str | None = None,
                             train_split: str = "train", eval_split: str | None = None, eval_name: str | None = None,
                             prepare: Callable[[list[dict], str], list[dict]] | None = None,
                             encoding_errors: str = "strict") -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                                       dict[str, Any]]:
    """``--streaming``: (the first ``train_rows`` rows of the Hub dataset ``name``'s ``train_split``, the first
    ``eval_rows`` held-out rows, info), read with ``datasets.load_dataset(..., streaming=True)`` so that only
    those rows are fetched (in the stream's order; no shuffle buffer). Held-out rows come from ``eval_name``
    (a local file or folder, read as usual, or a Hub id, streamed) or else from ``eval_split`` (default
    ``test``) of ``name``. Local data is refused: it is read line by line already."""
    if is_local(name):
        raise UserError(f"--streaming: {name!r} is local; streaming is for Hub datasets (local .jsonl / .parquet "
                        "files are read incrementally anyway): drop --streaming")

    def load(source: str, split: str, n: int) -> list[dict[str, Any]]:
        local = is_local(source)
        rows = load_dataset_rows(source, split, config_name, encoding_errors=encoding_errors, streaming=not local,
                                 limit=n)
        whole = local and not Path(source).expanduser().is_dir()
        return prepare(rows, source if whole else f"{source} [{split}]") if prepare else rows

    train = load(name, train_split, train_rows)
    source, split = (eval_name, eval_split or "test") if eval_name is not None else (name, eval_split or "test")
    held_out = load(source, split, eval_rows)
    whole = is_local(source) and not Path(source).expanduser().is_dir()
    return train, held_out, {"eval_source": source if whole else f"{source} [{split}]", "streaming": True,
                             "streamed_rows": {"train": len(train), "eval": len(held_out)}}


def row_key(row: Any) -> str:
    """A row's identity for de-duplication: the SHA-256 of its JSON with sorted keys (bytes by their SHA-256,
    images and other objects by ``repr``), so that a set of keys stays small whatever the rows hold."""
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=_key_of).encode()).hexdigest()


def _key_of(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"bytes:{hashlib.sha256(value).hexdigest()}"
    return repr(value)


def split_off(rows: list[Any], fraction: float, seed: int = SPLIT_SEED, source: str = "dataset") -> tuple[list, list]:
    """(rest, held out): ``round(fraction * n)`` rows (at least one) drawn with ``seed``; the rest keep order."""
    if not 0.0 < fraction < 1.0:
        raise UserError(f"--eval_fraction: must be between 0 and 1, got {fraction}")
    n_eval = max(1, round(fraction * len(rows)))
    if len(rows) - n_eval < 1:
        raise UserError(f"{source}: {len(rows)} rows are too few to hold out {fraction:g} for evaluation; "
                        "pass --eval_dataset_name")
    held = set(random.Random(seed).sample(range(len(rows)), n_eval))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]
