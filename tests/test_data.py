"""Data loading and validation: local files and folders, held-out splits, TRL prompt formats, token limits,
image paths. Every user mistake is a one-line UserError naming the file, line or row."""

from __future__ import annotations

import io
import json

import pytest

from unialign.config import UserError
from unialign.data import load_dataset_rows, read_file, split_files, split_off, train_eval_rows
from unialign.text.data import limit_rows, prompt_rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"prompt": f"What is {i}+1?", "solution": str(i + 1)} for i in range(20)]


def test_jsonl_json_and_parquet_files_read_alike(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    (tmp_path / "c.json").write_text(json.dumps({"prompt": [r["prompt"] for r in ROWS],
                                                 "solution": [r["solution"] for r in ROWS]}))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    for name in ("a.jsonl", "b.json", "c.json", "d.parquet"):
        assert read_file(tmp_path / name) == ROWS, name
    # rows missing a column get None there, as datasets does
    write_jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "solution": "1"}, {"prompt": "y"}])
    assert read_file(tmp_path / "e.jsonl")[1] == {"prompt": "y", "solution": None}


def test_bad_files_are_one_line_errors_naming_file_and_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match="empty.jsonl' has no rows"):
        read_file(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:3: not valid JSON"):
        read_file(tmp_path / "bad.jsonl")
    (tmp_path / "list.jsonl").write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(UserError, match=r"list.jsonl:2: expected a JSON object"):
        read_file(tmp_path / "list.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError, match="not a readable parquet file"):
        read_file(tmp_path / "bad.parquet")
    with pytest.raises(UserError, match="does not exist"):
        read_file(tmp_path / "missing.jsonl")


def test_folder_splits_found_by_name_like_datasets(tmp_path):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "train.jsonl", ROWS[:10])
    write_jsonl(tmp_path / "data" / "test-00000-of-00001.jsonl", ROWS[10:15])
    write_jsonl(tmp_path / "dev.jsonl", ROWS[15:])
    splits = split_files(tmp_path)
    assert sorted(splits) == ["test", "train", "validation"]
    assert load_dataset_rows(str(tmp_path), "test") == ROWS[10:15]
    with pytest.raises(UserError, match=r"no 'holdout' split; found \['test', 'train', 'validation'\]"):
        load_dataset_rows(str(tmp_path), "holdout")
    # files naming no split are all training data
    other = tmp_path / "other"
    other.mkdir()
    write_jsonl(other / "mine.jsonl", ROWS)
    assert list(split_files(other)) == ["train"]


def test_held_out_rows_never_train(tmp_path):
    f = write_jsonl(tmp_path / "one.jsonl", ROWS)
    train, held, info = train_eval_rows(str(f), eval_fraction=0.25)
    assert len(held) == 5 and len(train) == 15
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert info["eval_fraction"] == 0.25 and info["eval_split_seed"] == 0
    assert [ROWS[i] for i in info["row_ids"]["train"]] == train and [ROWS[i] for i in info["row_ids"]["eval"]] == held
    # validation runs on the file's rows before any are held out: errors name rows as in the file
    bad = write_jsonl(tmp_path / "bad.jsonl", ROWS[:7] + [{"prompt": ""}] + ROWS[7:])
    with pytest.raises(UserError, match=r"bad.jsonl row 7: field 'prompt' must be a non-empty string"):
        train_eval_rows(str(bad), prepare=prompt_rows)
    # fixed seed: the same held-out rows every time, whatever the training seed
    assert train_eval_rows(str(f), eval_fraction=0.25)[1] == held
    # a folder with test.jsonl uses it; one with only train.jsonl holds out a fraction
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS[:16])
    assert len(train_eval_rows(str(folder))[1]) == 2
    write_jsonl(folder / "test.jsonl", ROWS[16:])
    train, held, info = train_eval_rows(str(folder))
    assert held == ROWS[16:] and train == ROWS[:16] and "eval_fraction" not in info
    # a separate eval file
    train, held, info = train_eval_rows(str(f), eval_name=str(folder / "test.jsonl"))
    assert train == ROWS and held == ROWS[16:]
    with pytest.raises(UserError, match="single file without splits"):
        train_eval_rows(str(f), eval_split="test")
    with pytest.raises(UserError, match="too few"):
        split_off(ROWS[:1], 0.1)


def test_copies_of_held_out_rows_never_train(tmp_path):
    rows = ROWS[:4] * 10  # 40 rows, 4 distinct
    train, held, info = train_eval_rows(str(write_jsonl(tmp_path / "dups.jsonl", rows)), eval_fraction=0.1)
    assert len(held) == 4 and not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert info["train_duplicates_of_held_out_dropped"] == 36 - len(train)
    assert [rows[i] for i in info["row_ids"]["train"]] == train
    with pytest.raises(UserError, match="every training row is a copy of a held-out row"):
        train_eval_rows(str(write_jsonl(tmp_path / "same.jsonl", ROWS[:1] * 10)), eval_fraction=0.1)


def test_prompt_formats_trl_standard_conversational_and_gsm8k():
    rows = prompt_rows([
        {"prompt": "2+2?", "solution": "4"},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}], "solution": "5"},
        {"question": "3+3?", "answer": "#### 6"},
    ])
    assert rows[0] == {"prompt": "2+2?", "solution": "4"} and rows[1]["prompt"][1]["content"] == "2+3?"
    assert rows[2] == {"prompt": "3+3?", "answer": "#### 6"}
    for bad, message in (({"prompt": ""}, "row 0: field 'prompt' must be a non-empty string"),
                         ({"prompt": [{"content": "x"}]}, "row 0: field 'prompt' is a list but not a conversation"),
                         ({"prompt": [{"role": "wizard", "content": "x"}]}, "unknown role 'wizard'"),
                         ({"text": "hello"}, "row 0: no 'prompt' column"),
                         ({"question": "q", "answer": None}, "row 0: field 'answer' must be a non-empty string")):
        with pytest.raises(UserError, match=message):
            prompt_rows([bad], "train")


def test_limit_rows_refuses_naming_rows_or_drops_counted():
    rows = [{"prompt": "a" * n} for n in (3, 50, 4, 60)]
    count = {"prompt": (10, lambda prompts, limit: [len(p) for p in prompts])}
    with pytest.raises(UserError, match=r"train: 2 of 4 rows are too long \(row 1: prompt has 50 tokens > 10; "
                                        r"row 3: prompt has 60 tokens > 10\); raise --max_prompt_length"):
        limit_rows(rows, count, "error", "train")
    kept, dropped = limit_rows(rows, count, "drop", "train")
    assert kept == [rows[0], rows[2]] and dropped == [1, 3]
    # rows held out of a file are named by their row in the file
    with pytest.raises(UserError, match=r"data.jsonl: 2 of 4 rows are too long \(row 12: prompt has 50"):
        limit_rows(rows, count, "error", "data.jsonl", row_ids=[10, 12, 14, 17])
    assert limit_rows(rows, {"prompt": (None, None)}) == (rows, [])


def test_prompt_token_counter_counts_template_and_special_tokens(tiny_policy):
    from unialign.text.data import prompt_token_counter

    count = prompt_token_counter(tiny_policy)
    raw, chat = "12+30", [{"role": "user", "content": "12+30"}]
    expected = [len(tiny_policy._encode_prompts([p])["input_ids"][0]) for p in (raw, chat)]
    assert count([raw, chat], 0) == expected  # limit 0: every prompt tokenized
    # texts whose UTF-8 length (+ slack) is within the limit are not tokenized: their bound is reported
    bounds = count([raw, chat], 1000)
    assert all(e <= b <= 1000 for e, b in zip(expected, bounds))
    assert count(["x" * 5000], 1000)[0] == len(tiny_policy._encode_prompts(["x" * 5000])["input_ids"][0])


def test_image_columns_as_paths_bytes_and_feature_dicts(tmp_path):
    from PIL import Image

    from unialign.image.data import normalize_pickapic

    (tmp_path / "img").mkdir()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "img" / "a.png")
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 0, 255)).save(buf, format="PNG")
    rows = [{"caption": "red", "jpg_0": "img/a.png", "jpg_1": {"bytes": buf.getvalue(), "path": None}, "label_0": 1},
            {"caption": "blue", "jpg_0": {"bytes": None, "path": str(tmp_path / "img" / "a.png")},
             "jpg_1": buf.getvalue(), "label_0": 0}]
    pairs, ties = normalize_pickapic(rows, "train", tmp_path)
    assert ties == 0 and pairs[0]["chosen"].getpixel((0, 0)) == (255, 0, 0)
    assert pairs[1]["chosen"].getpixel((0, 0)) == (0, 0, 255)
    with pytest.raises(ValueError, match=r"train row 0: field 'jpg_0' is not a readable image \(no image file"):
        normalize_pickapic([{**rows[0], "jpg_0": "img/missing.png"}], "train", tmp_path)
