"""Rows of a dataset from a Hugging Face Hub id, a local file or a local folder, and the held-out split.

``load_dataset_rows(name, split)`` gives a list of dicts from

* a local ``.jsonl`` / ``.json`` / ``.parquet`` file (the whole file, whatever ``split`` says). JSON lines
  are read one line at a time (memory: the rows kept), so that a bad line is reported with its number
  as soon as it is read; a ``.json`` file (read whole) may hold a list of objects, a mapping of
  equal-length columns, or JSON lines; parquet is read a record batch at a time;
* a local folder: the split's files that ``datasets.load_dataset(folder)`` would read, found by datasets'
  own rules (``split_files``: README.md ``configs``, ``data/<split>-00000-of-00001.parquet`` shards, a
  ``train/`` folder, ``dev.json``, ...); a folder whose files name no split is all ``train``;
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
import os
import random
from collections.abc import Callable, Iterable, Iterator
from glob import has_magic
from pathlib import Path
from typing import Any

from unialign.config import UserError
from unialign.hub import HubUnavailableError, require_hub

SUFFIXES = (".jsonl", ".json", ".parquet")
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
def split_files(folder: str | Path, config_name: str | None = None) -> dict[str, list[Path]]:
    """Data files of ``folder`` by split (each split's files sorted by path; ``{}`` when it holds none): the
    files ``datasets.load_dataset(folder, config_name)`` would read, found by datasets' own code
    (``datasets.data_files``, no row is read), in its order of precedence:

    1. the ``configs`` of the folder's dataset card (``README.md`` YAML, ``.huggingface.yaml``): those of
       ``config_name``, else of the default config -- their ``data_files``, or the rules below in ``data_dir``;
    2. shards ``data/<split>-00000-of-00002.parquet`` (any split name);
    3. split folders (``train/``, ``data/valid/``), else split file names (``train.jsonl``, ``dev.json``,
       ``my-test_0.parquet``; the keywords are ``datasets.data_files.SPLIT_KEYWORDS``);
    4. else every file is ``train``.

    As in datasets, hidden files and folders, ``__*`` folders and ``config.json`` / ``dataset_info.json`` / ...
    are no data. Kept here, as datasets does not do it: only ``SUFFIXES`` files count, as if the folder held
    nothing else (datasets reads a folder with one builder, chosen by its most common file type, and picks the
    split patterns over every file: a folder of PNGs with its ``pairs.jsonl`` would be read as images, a
    ``train_notes.csv`` would make ``train`` the CSV); a file that two patterns of a split match is listed
    once (datasets reads it twice); ``config_name`` is ignored when the card names no configs (datasets
    accepts only "default" then).

    Raises UserError where datasets refuses the folder's card: several configs and no ``config_name`` nor
    default, an unknown ``config_name``, a listed file that is missing (or not of ``SUFFIXES``), a split with
    no file; and for a shard split name datasets refuses."""
    from datasets.data_files import _get_data_files_patterns, resolve_pattern

    folder = Path(folder).expanduser()
    base = folder.resolve()

    def resolve(pattern: str, root: Path) -> list[str]:
        """datasets' resolution of ``pattern`` under ``root``, only files this module reads; FileNotFoundError
        when none (what datasets' pattern search expects of a resolver)."""
        found = [f for f in resolve_pattern(pattern, root.as_posix(), allowed_extensions=list(SUFFIXES))
                 if Path(f).suffix in SUFFIXES]  # resolve_pattern also keeps train.jsonl.gz, notes.json.bak
        if not found:
            raise FileNotFoundError(pattern)
        return found

    readme, root, patterns = _readme_patterns(base, config_name)
    if patterns is None:
        try:  # get_data_patterns(root) with our resolver: the search over the files we read
            patterns = _get_data_files_patterns(lambda pattern: resolve(pattern, root))
        except FileNotFoundError:
            return {}
        except ValueError as err:  # a shard's split name that datasets refuses
            raise UserError(f"dataset folder {str(folder)!r}: {err}") from None
    out: dict[str, list[Path]] = {}
    for split, split_patterns in patterns.items():
        files: set[str] = set()
        for pattern in split_patterns:
            try:
                files.update(resolve(pattern, root))
            except FileNotFoundError:
                if not has_magic(pattern):  # a file a README config names
                    raise UserError(f"{readme}: data file {pattern!r} of split {split!r} is missing or not a "
                                    f"{' / '.join(SUFFIXES)} file") from None
        if not files:  # a README split of other file types (the inferred splits all have files)
            raise UserError(f"{readme}: split {split!r} ({', '.join(split_patterns)}) has no "
                            f"{' / '.join(SUFFIXES)} file")
        out[str(split)] = sorted(folder / os.path.relpath(f, base) for f in files)  # str: not a NamedSplit
    return out


def _readme_patterns(base: Path, config_name: str | None) -> tuple[Path, Path, dict[str, list[str]] | None]:
    """(README.md path, root of the patterns, split -> data file patterns) of the config of ``base``'s dataset
    card YAML that ``datasets.load_dataset(base, config_name)`` would use (``datasets``' ``MetadataConfigs``
    and ``sanitize_patterns``, read as ``LocalDatasetModuleFactory`` reads them). Patterns are None when the
    card names no configs or the config lists no ``data_files`` (then datasets infers them under the root:
    the folder, or its ``data_dir``)."""
    import yaml
    from datasets import config as datasets_config
    from datasets.data_files import sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard, DatasetCardData

    readme, standalone = base / datasets_config.REPOCARD_FILENAME, base / datasets_config.REPOYAML_FILENAME
    try:
        card = DatasetCard.load(readme).data if readme.is_file() else DatasetCardData()
        if standalone.is_file():
            extra = yaml.safe_load(standalone.read_text(encoding="utf-8"))
            if extra:
                card = DatasetCardData(**{**card.to_dict(), **extra})
        configs = MetadataConfigs.from_dataset_card_data(card)
        default = configs.get_default_config_name() if configs else None
    except Exception as err:  # noqa: BLE001 - YAML, card and config errors come in many types
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(f"{readme}: its dataset card YAML is not one datasets reads: {type(err).__name__}: "
                        f"{first}") from None
    if not configs:
        return readme, base, None
    name = config_name or default
    if name is None:
        raise UserError(f"{readme}: the dataset has several configs and none is the default; pick one of "
                        f"{sorted(configs)} (--dataset_config)")
    if name not in configs:
        raise UserError(f"{readme}: no config {name!r}; the configs are {sorted(configs)}")
    params = configs[name]
    root = base / params["data_dir"] if params.get("data_dir") else base
    files = params.get("data_files")
    return readme, root, None if files is None else {split: list(p) for split, p in sanitize_patterns(files).items()}


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
        splits = split_files(path, config_name)
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
        splits = split_files(path, config_name)
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
