"""Rows of a dataset from a Hugging Face Hub id, a local file or a local folder, and the held-out split.

``load_dataset_rows(name, split)`` gives a list of dicts from

* a local ``.jsonl`` / ``.json`` / ``.parquet`` file (the whole file, whatever ``split`` says). JSON lines
  are parsed here so that a bad line is reported with its number; a ``.json`` file may hold a list of
  objects, a mapping of equal-length columns, or JSON lines;
* a local folder: the split's files found by name as ``datasets.load_dataset(folder)`` does
  (``train.jsonl``, ``test-00000-of-00001.parquet``, ``data/validation.json``, a ``train/`` folder, ...;
  ``SPLIT_KEYWORDS`` lists the accepted spellings); a folder whose files name no split is all ``train``;
* a Hub id (``datasets.load_dataset(name, config, split=split)``; fails at once, clearly, offline).

Rows missing a column that others have get ``None`` there, as ``datasets`` does. ``train_eval_rows``
resolves the training rows and the held-out rows: a separate eval dataset, an eval split, or -- for a
single local file, or a folder without an eval split -- a fraction split off the training rows with a
fixed seed, so that evaluation never sees a training row. Every problem is a ``UserError`` (one line,
exit 2 in the scripts) naming the file, and the line or row.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
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


def is_local(name: str) -> bool:
    """Whether ``name`` names a local file or folder (an existing path, or a path with a data suffix)."""
    return Path(name).expanduser().exists() or Path(name).suffix in SUFFIXES


# ------------------------------------------------------------------ files
def read_file(path: str | Path) -> list[dict[str, Any]]:
    """All rows of one .jsonl / .json / .parquet file (``UserError`` naming the file, line or row)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"dataset file {str(path)!r} does not exist")
    if path.suffix not in SUFFIXES:
        raise UserError(f"dataset file {str(path)!r}: unsupported type {path.suffix!r}; use {', '.join(SUFFIXES)}")
    if path.suffix == ".parquet":
        rows = _read_parquet(path)
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        rows = _read_json(path, text) if path.suffix == ".json" else _read_json_lines(path, text)
    if not rows:
        raise UserError(f"dataset file {str(path)!r} has no rows")
    return _fill_columns(rows)


def _read_json_lines(path: Path, text: str) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        rows.append(row)
    return rows


def _read_json(path: Path, text: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.lineno > 1:  # JSON lines in a .json file (datasets reads those too)
            return _read_json_lines(path, text)
        raise UserError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
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


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
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
def load_dataset_rows(name: str, split: str | None, config_name: str | None = None) -> list[dict[str, Any]]:
    """Rows of a local file (all of it), a split of a local folder, or a split of a Hub dataset."""
    path = Path(name).expanduser()
    if path.is_dir():
        splits = split_files(path)
        if not splits:
            raise UserError(f"dataset folder {name!r} has no .jsonl / .json / .parquet files")
        if split not in splits:
            raise UserError(f"dataset folder {name!r} has no {split!r} split; found {sorted(splits)}")
        return [row for f in splits[split] for row in read_file(f)]
    if path.suffix in SUFFIXES:
        return read_file(path)
    return _load_hub(name, split or "train", config_name)


def _load_hub(name: str, split: str, config_name: str | None) -> list[dict[str, Any]]:
    import datasets

    require_hub(name, "dataset")
    try:
        ds = datasets.load_dataset(name, config_name, split=split)
    except HubUnavailableError:
        raise
    except Exception as err:  # noqa: BLE001 - hub / connection errors come in many types
        first = str(err).splitlines()[0] if str(err) else ""
        raise UserError(
            f"could not load dataset {name!r} (config {config_name!r}, split {split!r}): {type(err).__name__}: "
            f"{first}. Pass a local .jsonl/.json/.parquet file or folder with the same schema, or a Hub id that "
            "is reachable (and its --dataset_config).") from None
    rows = [dict(r) for r in ds]
    if not rows:
        raise UserError(f"dataset {name!r} split {split!r} has no rows")
    return rows


def train_eval_rows(name: str, *, config_name: str | None = None, train_split: str = "train",
                    eval_split: str | None = None, eval_name: str | None = None, eval_fraction: float = 0.1,
                    seed: int = SPLIT_SEED, prepare: Callable[[list[dict], str], list[dict]] | None = None,
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
    """
    path = Path(name).expanduser()
    single_file = not path.is_dir() and is_local(name)
    if single_file and eval_split is not None and eval_name is None:
        raise UserError(f"--eval_split {eval_split!r}: {name!r} is a single file without splits; pass the held-out "
                        "file with --eval_dataset_name, or leave --eval_split unset to hold out --eval_fraction")

    def load(source: str, split: str | None) -> list[dict[str, Any]]:
        rows = load_dataset_rows(source, split, config_name)
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


def row_key(row: Any) -> str:
    """A row's identity for de-duplication: its JSON with sorted keys (images and other objects by repr)."""
    return json.dumps(row, sort_keys=True, default=repr)


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
