"""Parts taken from the libraries that do the job, checked against the libraries themselves and
against values written out here: the learning-rate schedules (transformers' ``get_scheduler``) and the split
discovery of a local data folder (``datasets.data_files``, compared with ``datasets.load_dataset(folder)``)."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from unialign.config import SCHEDULERS, UserError
from unialign.data import load_dataset_rows, split_files
from unialign.trainers.schedule import TRANSFORMERS_SCHEDULES, lr_lambda, make_optimizer
from unialign.trainers.train_config import TrainConfig


# ------------------------------------------------------------------ learning-rate schedules
def _transformers(kind: str, warmup: int, total: int):
    """transformers' own multiplier for the same (warmup, total), unshifted."""
    from transformers.optimization import get_scheduler

    probe = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    return get_scheduler(TRANSFORMERS_SCHEDULES[kind], probe, num_warmup_steps=warmup,
                         num_training_steps=total).lr_lambdas[0]


def test_every_configurable_schedule_has_a_transformers_name():
    assert set(TRANSFORMERS_SCHEDULES) == set(SCHEDULERS)
    with pytest.raises(ValueError, match="constant, linear or cosine, got 'step'"):
        lr_lambda("step", 0, 10)


R2 = math.sqrt(2)
REFERENCE = {  # (kind, warmup, total): the multiplier at steps 0 .. total, written out by hand
    ("constant", 3, 8): [1 / 4, 2 / 4, 3 / 4, 1, 1, 1, 1, 1, 1],
    ("constant", 0, 3): [1, 1, 1, 1],
    ("linear", 2, 6): [1 / 3, 2 / 3, 1, 3 / 4, 2 / 4, 1 / 4, 0],
    ("linear", 0, 4): [1, 3 / 4, 2 / 4, 1 / 4, 0],
    ("cosine", 2, 6): [1 / 3, 2 / 3, 1, (2 + R2) / 4, 1 / 2, (2 - R2) / 4, 0],
    ("cosine", 0, 4): [1, (2 + R2) / 4, 1 / 2, (2 - R2) / 4, 0],
    ("linear", 4, 4): [1 / 5, 2 / 5, 3 / 5, 4 / 5, 0],  # warm-up over the whole run; 0 after the last step
    ("cosine", 5, 3): [1 / 6, 2 / 6, 3 / 6, 4 / 6],  # the run ends inside the warm-up
}


@pytest.mark.parametrize("key", list(REFERENCE), ids=lambda k: f"{k[0]}-w{k[1]}-T{k[2]}")
def test_schedules_give_the_reference_values(key):
    fn = lr_lambda(*key)
    assert [fn(s) for s in range(len(REFERENCE[key]))] == pytest.approx(REFERENCE[key], rel=1e-15, abs=1e-15)


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_after_warmup_the_schedule_is_transformers_and_the_warmup_starts_above_zero(kind):
    """The one documented difference: transformers warms up as s / w (lr 0 at the first step), unialign as
    (s + 1) / (w + 1); from the end of the warm-up on, the values are transformers' own, bit for bit."""
    for warmup in range(0, 7):
        for total in range(warmup + 1, 30):
            ours, theirs = lr_lambda(kind, warmup, total), _transformers(kind, warmup, total)
            assert [ours(s) for s in range(warmup, total + 1)] == [theirs(s) for s in range(warmup, total + 1)]
            assert [ours(s) for s in range(warmup)] == [(s + 1) / (warmup + 1) for s in range(warmup)]
            assert [theirs(s) for s in range(warmup)] == [s / warmup for s in range(warmup)]


EMBEDDED = [("cosine", 5, 100), ("constant", 10, 500), ("constant", 50, 1000), ("constant", 200, 2000),
            ("cosine", 0, 60), ("constant", 0, 60)]  # scripts' defaults and presets


@pytest.mark.parametrize("key", EMBEDDED, ids=lambda k: f"{k[0]}-w{k[1]}-T{k[2]}")
def test_the_defaults_numbers_are_those_of_the_former_schedule_bit_for_bit(key):
    """The closed form the hand-written schedule computed (warm-up (s + 1) / (w + 1), then constant or the
    cosine to 0 at T): every step of the scripts' defaults is the same float."""
    kind, warmup, total = key

    def former(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))

    fn = lr_lambda(kind, warmup, total)
    assert [fn(s) for s in range(total + 1)] == [former(s) for s in range(total + 1)]


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_the_schedule_survives_a_checkpoint_and_keeps_no_code_in_it(kind):
    cfg = TrainConfig(lr_scheduler_type=kind, warmup_steps=3, max_steps=12, learning_rate=2e-3)

    def run(steps: int, state: dict | None = None):
        param = torch.nn.Parameter(torch.zeros(3))
        optimizer, scheduler = make_optimizer([param], cfg)
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
        lrs = []
        for _ in range(steps):
            lrs.append(optimizer.param_groups[0]["lr"])
            param.grad = torch.ones(3)
            optimizer.step()
            scheduler.step()
        return lrs, {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}

    whole, _ = run(12)
    assert whole == [2e-3 * lr_lambda(kind, 3, 12)(s) for s in range(12)]
    first, state = run(5)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = torch.load(buf, weights_only=True)  # plain data only: no function was pickled
    assert restored["scheduler"]["lr_lambdas"] in ([None], [{}]) and restored["scheduler"]["last_epoch"] == 5
    rest, _ = run(7, restored)
    assert first + rest == whole


# ------------------------------------------------------------------ split discovery of a local folder
def _write(folder, files):
    """One row per file, naming the file, so that the rows datasets loads tell which files it read."""
    for name in files:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        row = {"f": name}
        if path.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist([row]), path)
        elif path.suffix == ".json":
            path.write_text(json.dumps([row]))
        else:
            path.write_text(json.dumps(row) + "\n")


def _ours(folder, config_name=None):
    return {split: sorted(p.relative_to(folder).as_posix() for p in files)
            for split, files in split_files(folder, config_name).items()}


def _datasets(folder, cache, config_name=None):
    import datasets

    loaded = datasets.load_dataset(str(folder), config_name, cache_dir=str(cache))
    return {split: sorted(row["f"] for row in rows) for split, rows in loaded.items()}


LAYOUTS = {
    "split file names": ["train.jsonl", "data/test.jsonl", "dev.jsonl"],
    "spellings": ["my-train-1.jsonl", "eval_set.jsonl", "val.json", "testing.jsonl"],
    "split folders win over file names": ["train/a.jsonl", "train/b.jsonl", "test/c.jsonl", "notes_test.jsonl"],
    "nested split folders": ["data/train/x.jsonl", "data/dev/y.jsonl", "data/test.jsonl"],
    "shards win, any split name": ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
                                   "data/random-00000-of-00001.parquet", "dev.jsonl", "train.jsonl"],
    "no split named: all train": ["mine.jsonl", "more/other.json"],
    "hidden, __ folders and metadata files": ["train.jsonl", ".cache/test.jsonl", "__old__/test.jsonl",
                                              "config.json", "dataset_info.json"],
    "a keyword is a whole word": ["training.jsonl", "valid/a.jsonl", "contest.jsonl"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_folders_splits_are_the_files_datasets_load_dataset_reads(name, tmp_path):
    folder = tmp_path / "d"
    _write(folder, LAYOUTS[name])
    assert _ours(folder) == _datasets(folder, tmp_path / "cache")


README_DEFAULT = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: "a/*.jsonl"
  - split: test
    path: b.jsonl
---
# card
"""
README_TWO = """---
configs:
- config_name: main
  data_dir: main
- config_name: socratic
  data_dir: socratic
---
"""
README_MARKED = """---
configs:
- config_name: one
  data_files: "one/*.jsonl"
- config_name: two
  default: true
  data_files:
  - split: train
    path: ["two/p*.jsonl", "two/q.jsonl"]
  - split: held_out
    path: two/e.jsonl
---
"""


@pytest.mark.parametrize("readme, files, config_name", [
    (README_DEFAULT, ["a/x.jsonl", "a/y.jsonl", "b.jsonl", "train.jsonl"], None),
    (README_TWO, ["main/train.jsonl", "main/test.jsonl", "socratic/train.jsonl"], "main"),
    (README_TWO, ["main/train.jsonl", "main/test.jsonl", "socratic/train.jsonl"], "socratic"),
    (README_MARKED, ["one/a.jsonl", "two/p1.jsonl", "two/p2.jsonl", "two/q.jsonl", "two/e.jsonl"], None),
    (README_MARKED, ["one/a.jsonl", "two/p1.jsonl", "two/p2.jsonl", "two/q.jsonl", "two/e.jsonl"], "one"),
], ids=["default config", "data_dir main", "data_dir socratic", "marked default", "named config"])
def test_the_configs_of_a_dataset_card_are_followed_like_datasets(readme, files, config_name, tmp_path):
    folder = tmp_path / "d"
    _write(folder, files)
    (folder / "README.md").write_text(readme)
    assert _ours(folder, config_name) == _datasets(folder, tmp_path / "cache", config_name)


def test_a_card_whose_config_is_ambiguous_or_unknown_is_refused_as_datasets_refuses_it(tmp_path):
    folder = tmp_path / "d"
    _write(folder, ["main/train.jsonl", "socratic/train.jsonl"])
    (folder / "README.md").write_text(README_TWO)
    with pytest.raises(UserError, match=r"several configs.*\['main', 'socratic'\].*--dataset_config"):
        split_files(folder)
    with pytest.raises(UserError, match=r"no config 'nope'; the configs are \['main', 'socratic'\]"):
        load_dataset_rows(str(folder), "train", "nope")
    with pytest.raises(ValueError, match="Config name is missing"):
        _datasets(folder, tmp_path / "cache")
    (folder / "README.md").write_text(README_DEFAULT)  # a split of no file, a listed file missing: datasets fails
    _write(folder, ["b.jsonl"])
    with pytest.raises(UserError, match=r"split 'train' \(a/\*.jsonl\) has no .jsonl / .json / .parquet file"):
        split_files(folder)
    with pytest.raises(ValueError, match="Couldn't infer the same data file format"):
        _datasets(folder, tmp_path / "cache")
    _write(folder, ["a/x.jsonl"])
    (folder / "b.jsonl").unlink()
    with pytest.raises(UserError, match=r"data file 'b.jsonl' of split 'test' is missing"):
        split_files(folder)
    with pytest.raises(FileNotFoundError, match="Unable to find .*b.jsonl"):
        _datasets(folder, tmp_path / "cache")


def test_where_unialign_differs_from_datasets_on_purpose(tmp_path):
    """Only the files unialign reads count; a file is read once."""
    images = tmp_path / "images"  # datasets would read this folder as an imagefolder (the PNGs outnumber)
    _write(images, ["pairs.jsonl"])
    (images / "img").mkdir()
    for i in range(3):
        (images / "img" / f"test_{i}.png").write_bytes(b"\x89PNG")
    assert _ours(images) == {"train": ["pairs.jsonl"]}
    other = tmp_path / "other"  # a .gz / .csv beside the data: not data here (no split of its own either)
    _write(other, ["data.jsonl"])
    (other / "test.jsonl.gz").write_bytes(b"")
    (other / "train_notes.csv").write_text("a\n1\n")
    assert _ours(other) == {"train": ["data.jsonl"]}
    twice = tmp_path / "twice"  # matches two of datasets' train patterns: datasets lists (and reads) it twice
    _write(twice, ["train-train.jsonl", "test.jsonl"])
    assert _ours(twice) == {"train": ["train-train.jsonl"], "test": ["test.jsonl"]}
    assert _datasets(twice, tmp_path / "cache")["train"] == ["train-train.jsonl"] * 2
    mixed = tmp_path / "mixed"  # datasets needs one file type for the whole folder; each file is read by its own
    _write(mixed, ["train.jsonl", "test.parquet"])
    assert load_dataset_rows(str(mixed), "test") == [{"f": "test.parquet"}]


def test_folder_errors_for_users_are_unchanged(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("# nothing here\n")
    assert split_files(empty) == {}
    with pytest.raises(UserError, match=r"dataset folder '.*empty' has no .jsonl / .json / .parquet files"):
        load_dataset_rows(str(empty), "train")
    _write(tmp_path / "d", ["train.jsonl", "test.jsonl"])
    with pytest.raises(UserError, match=r"has no 'validation' split; found \['test', 'train'\]"):
        load_dataset_rows(str(tmp_path / "d"), "validation")
