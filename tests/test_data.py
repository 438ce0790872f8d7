"""Data loading and validation: local files and folders, held-out splits, TRL prompt formats, token limits,
image paths. Every user mistake is a one-line UserError naming the file, line or row."""

from __future__ import annotations

import io
import json
import re

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
    write_jsonl(tmp_path / "data" / "test.jsonl", ROWS[10:15])
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
    # shards data/<split>-00000-of-00001.* take precedence over every other file, as in datasets
    write_jsonl(tmp_path / "data" / "test-00000-of-00001.jsonl", ROWS[10:15])
    assert {k: [p.name for p in v] for k, v in split_files(tmp_path).items()} == {"test": ["test-00000-of-00001.jsonl"]}


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
    assert ties == 0 and pairs[0]["chosen"].decode().getpixel((0, 0)) == (255, 0, 0)
    assert pairs[1]["chosen"].decode().getpixel((0, 0)) == (0, 0, 255)
    with pytest.raises(ValueError, match=r"train row 0: field 'jpg_0': no image file"):
        normalize_pickapic([{**rows[0], "jpg_0": "img/missing.png"}], "train", tmp_path)


# ------------------------------------------------------------------ large / hostile files
def test_jsonl_is_read_line_by_line_so_a_bad_early_line_costs_no_memory(tmp_path):
    import tracemalloc

    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        f.write('{"prompt": "a"}\n{"prompt": oops}\n')
        line = json.dumps({"prompt": "x" * 1000}) + "\n"
        f.write(line * 40_000)  # 40 MB after the bad line
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=r"big.jsonl:2: not valid JSON"):
            read_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB: the file was read whole"
    # a limit stops reading: rows after it are never parsed
    (tmp_path / "tail.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\nnot json at all\n')
    assert read_file(tmp_path / "tail.jsonl", limit=2) == [{"prompt": "a"}, {"prompt": "b"}]
    assert load_dataset_rows(str(tmp_path / "tail.jsonl"), "train", limit=1) == [{"prompt": "a"}]
    # lines are split at \n only: U+2028 inside a string is text, not a line break (str.splitlines split it)
    (tmp_path / "sep.jsonl").write_text(json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_file(tmp_path / "sep.jsonl") == [{"prompt": "a\u2028b"}]


def test_invalid_utf8_is_refused_by_file_and_line_unless_replaced(tmp_path):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"latin1.jsonl:2: not valid UTF-8 \(byte 0xe9 at byte 16 of the line\).*"
                                        r"--encoding_errors replace"):
        read_file(tmp_path / "latin1.jsonl")
    assert read_file(tmp_path / "latin1.jsonl", encoding_errors="replace")[1] == {"prompt": "caf\ufffd"}
    (tmp_path / "latin1.json").write_bytes(b'[\n{"prompt": "ok"},\n{"prompt": "caf\xe9"}\n]')
    with pytest.raises(UserError, match=r"latin1.json:3: not valid UTF-8"):
        read_file(tmp_path / "latin1.json")
    assert read_file(tmp_path / "latin1.json", encoding_errors="replace")[1] == {"prompt": "caf\ufffd"}
    with pytest.raises(UserError, match=r"latin1.jsonl:2: not valid UTF-8"):
        train_eval_rows(str(tmp_path / "latin1.jsonl"))
    # a UTF-8 byte-order mark is not an error
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n')
    (tmp_path / "bom.json").write_bytes(b'\xef\xbb\xbf[{"prompt": "a"}]')
    assert read_file(tmp_path / "bom.jsonl") == read_file(tmp_path / "bom.json") == [{"prompt": "a"}]


def test_pathological_nesting_is_a_one_line_error_naming_the_file(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "deep.json").write_text(deep)
    with pytest.raises(UserError, match=r"deep.json: JSON nested too deeply") as err:
        read_file(tmp_path / "deep.json")
    assert "\n" not in str(err.value)
    (tmp_path / "deep.jsonl").write_text('{"prompt": "a"}\n{"prompt": ' + deep + "}\n")
    with pytest.raises(UserError, match=r"deep.jsonl:2: JSON nested too deeply"):
        read_file(tmp_path / "deep.jsonl")
    # deep enough to break what reads the rows later (fingerprints, de-duplication), not the parser: refused too
    nested = '{"prompt": "a", "x": ' + "[" * 500 + "]" * 500 + "}"
    (tmp_path / "500.jsonl").write_text(nested + "\n")
    with pytest.raises(UserError, match=r"500.jsonl:1: JSON nested more than 100 levels deep"):
        read_file(tmp_path / "500.jsonl")
    (tmp_path / "500.json").write_text(f'[{{"prompt": "b"}}, {nested}]')
    with pytest.raises(UserError, match=r"500.json: row 1: JSON nested more than 100 levels deep"):
        read_file(tmp_path / "500.json")
    # ordinary conversations are far from the limit
    convo = [{"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}] * 50
    (tmp_path / "convo.json").write_text(json.dumps(convo))
    assert read_file(tmp_path / "convo.json") == convo


def test_parquet_is_read_in_batches_and_stops_at_the_limit(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"p{i}"} for i in range(3000)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "many.parquet", row_group_size=500)
    assert read_file(tmp_path / "many.parquet") == rows
    assert read_file(tmp_path / "many.parquet", limit=1200) == rows[:1200]


# ------------------------------------------------------------------ --streaming (Hub datasets)
def _streaming_cfg(tmp_path, **kw):
    from dataclasses import make_dataclass

    from unialign.recipes.text import TextDataArgs
    from unialign.trainers import OnlineConfig

    cls = make_dataclass("StreamCfg", [], bases=(TextDataArgs, OnlineConfig))
    return cls(**{"dataset_name": "someone/huge", "streaming": True, "max_steps": 3, "prompts_per_step": 4,
                  "num_generations": 2, "num_eval": 5, "output_dir": str(tmp_path / "out"), **kw})


def fake_hub(monkeypatch, files: dict[str, str]):
    """``datasets.load_dataset(<hub id>, ..., streaming=True)`` served from local JSON files (datasets' own
    streaming reader), the Hub check passed; returns the list of rows each stream has yielded, by split."""
    import datasets

    import unialign.data as data

    real, pulled = datasets.load_dataset, {}

    def load_dataset(name, config=None, split=None, streaming=False, **kw):
        assert streaming, "a --streaming run must not download the dataset"
        stream = real("json", data_files={split: files[split]}, split=split, streaming=True)

        class Counted:  # counts the rows the run pulls from the stream
            features = None

            def __iter__(self):
                for row in stream:
                    pulled.setdefault(split, []).append(row)
                    yield row

        return Counted()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(data, "require_hub", lambda name, kind="model", **kw: None)
    return pulled


def test_streaming_reads_only_the_rows_the_run_draws(tmp_path, monkeypatch):
    from unialign.recipes.text import load_prompt_data, rows_needed

    rows = [{"question": f"{i}+1?", "answer": f"#### {i + 1}"} for i in range(10_000)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "test.jsonl", rows[:100])
    pulled = fake_hub(monkeypatch, {"train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.jsonl")})
    cfg = _streaming_cfg(tmp_path)
    assert rows_needed(cfg) == 12  # 3 steps x 4 prompts
    train, held_out, info = load_prompt_data(cfg)
    assert [r["prompt"] for r in train] == [f"{i}+1?" for i in range(12)] and len(held_out) == 5
    assert len(pulled["train"]) == 12 and len(pulled["test"]) == 5  # nothing more was fetched
    assert info["streaming"] and info["streamed_rows"] == {"train": 12, "eval": 5}
    assert info["eval_source"] == "someone/huge [test]"
    # DAPO samples up to max_generation_rounds batches a step: the bound is read
    assert rows_needed(_streaming_cfg(tmp_path, algorithm="dapo", max_generation_rounds=3)) == 36
    # rows are validated as usual, named by split and row
    write_jsonl(tmp_path / "train.jsonl", rows[:3] + [{"question": ""}] + rows)
    with pytest.raises(UserError, match=r"someone/huge \[train\] row 3: field 'question'"):
        load_prompt_data(cfg)


def test_streaming_fails_fast_offline_and_refuses_local_data(tmp_path, monkeypatch):
    import time

    from unialign.embedded import register
    from unialign.hub import HubUnavailableError
    from unialign.recipes.text import load_prompt_data

    register()  # the demo's data set 'embedded' by name, as the scripts register it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.time()
    with pytest.raises(HubUnavailableError, match=r"cannot stream the dataset 'someone/huge': HF_HUB_OFFLINE is set"):
        load_prompt_data(_streaming_cfg(tmp_path))
    assert time.time() - start < 5
    f = write_jsonl(tmp_path / "local.jsonl", ROWS)
    with pytest.raises(UserError, match=r"--streaming: .*local.jsonl' is local"):
        load_prompt_data(_streaming_cfg(tmp_path, dataset_name=str(f)))
    with pytest.raises(UserError, match=r"--streaming: 'embedded' is a built-in data set"):
        load_prompt_data(_streaming_cfg(tmp_path, dataset_name="embedded"))


@pytest.mark.parametrize("name", ["grpo_math", "ppo_rlhf", "dpo_text", "train_reward_model", "dpo_sdxl",
                                  "grpo_image", "ddpo_aesthetic"])
def test_encoding_errors_and_streaming_are_flags_of_the_scripts(name, tmp_path):
    from tests.test_config import script_config
    from unialign.config import parse_config

    _, cls = script_config(name)
    out = ["--output_dir", str(tmp_path)]
    assert parse_config(cls, out).encoding_errors == "strict"
    assert parse_config(cls, ["--encoding_errors", "replace", *out]).encoding_errors == "replace"
    with pytest.raises(UserError, match="--encoding_errors: 'latin1' is not one of strict, replace"):
        parse_config(cls, ["--encoding_errors", "latin1", *out])
    if name in ("grpo_math", "ppo_rlhf", "dpo_text", "train_reward_model"):  # the scripts reading datasets' rows
        assert parse_config(cls, ["--streaming", *out]).streaming is True


def test_a_missing_local_path_is_named_as_missing_not_as_an_unreachable_hub(monkeypatch):
    from unialign.hub import HubUnavailableError, require_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("./no/such/model", "/tmp/definitely-missing-folder-xyz", "a/b/c", "rows.jsonl"):
        with pytest.raises(FileNotFoundError, match=re.escape(f"{name!r}: no such file or directory")):
            require_hub(name)
    with pytest.raises(HubUnavailableError, match="HF_HUB_OFFLINE is set"):
        require_hub("someone/model")  # a hub id stays a hub question
