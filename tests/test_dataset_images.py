"""Every image a data set names is checked before training, in the vision-language prompt path (grpo_vision), the
vision-language pair path (dpo_text) and the image-pair path (dpo_sdxl, Pick-a-Pic) alike: a decompression bomb, a
truncated or empty file, a FIFO, a folder, a path leading outside the data folder is one line naming the file and
row, exit 2, before any model loads; with --skip_bad_rows such rows are skipped and counted (log, summary.json)."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.test_scripts import run, run_cli


def bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A PNG whose header says width x height pixels (1.2 GB decoded as RGB) in a few hundred bytes: one zlib
    stream of zero rows, cut short (nothing reads past the header before the check)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * (3 * width + 1) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def jpeg(seed: int = 0) -> bytes:
    arr = np.random.RandomState(seed).randint(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def good_png(folder: Path, name: str, seed: int = 0) -> str:
    arr = np.random.RandomState(seed).randint(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(arr).save(folder / name)
    return name


BAD = {  # kind -> (make it under the data folder, returning the path a row names; what the line says)
    "bomb": (lambda d: (d / "bomb.png").write_bytes(bomb_png()) and "bomb.png",
             "the image is 20000 x 20000 = 400000000 pixels, over the limit of 89478485"),
    "truncated": (lambda d: (d / "cut.jpg").write_bytes(jpeg()[:1500]) and "cut.jpg", "not a decodable image"),
    "empty": (lambda d: (d / "empty.png").write_bytes(b"") is not None and "empty.png", "is an empty file (0 bytes)"),
    "fifo": (lambda d: os.mkfifo(d / "pipe.png") or "pipe.png", "'pipe.png' is a FIFO, not an image file"),
    "folder": (lambda d: (d / "dir.png").mkdir() or "dir.png", "'dir.png' is a folder, not an image file"),
    "outside": (lambda d: (d.parent / "secret.png").write_bytes(jpeg()) and "../secret.png",
                "'../secret.png' leads outside the data folder"),
}


@pytest.fixture
def no_vlm(monkeypatch):
    from unialign.vision.policy import VisionLanguagePolicy

    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr(VisionLanguagePolicy, "from_pretrained", classmethod(boom))


@pytest.fixture
def deadline():
    """A hang (a FIFO read) fails the test after 60 s instead of stalling the suite."""
    def stop(signum, frame):
        raise TimeoutError("hung")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def vision_rows(folder: Path, bad: str | None, pairs: bool = False, n: int = 4) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = []
        for i in range(n):
            image = bad if (bad and split == "train" and i == 2) else good_png(folder, f"{split}{i}.png", i)
            row = {"prompt": [{"role": "user", "content": "Colour?"}], "image": image}
            row.update({"chosen": "red", "rejected": "blue"} if pairs else {"solution": "red"})
            rows.append(row)
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def pickapic_rows(folder: Path, bad: str | None, n: int = 4) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = [{"caption": f"c{i}", "jpg_0": bad if (bad and split == "train" and i == 2) else
                 good_png(folder, f"{split}{i}a.png", i), "jpg_1": good_png(folder, f"{split}{i}b.png", 50 + i),
                 "label_0": 1} for i in range(n)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


PATHS = {  # the script, its arguments, how its rows are written, the row and field a line names
    "vision prompts": ("grpo_vision", ["--model_name_or_path", "embedded-vlm"], vision_rows,
                       "row 2: field 'image'"),
    "vision pairs": ("dpo_text", ["--model_name_or_path", "embedded-vlm"],
                     lambda d, bad: vision_rows(d, bad, pairs=True), "train row 2: field 'image'"),
    "image pairs": ("dpo_sdxl", [], pickapic_rows, "train row 2: field 'jpg_0'"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_bad_image_is_one_line_naming_it_before_any_model_loads(tmp_path, capsys, no_model, no_vlm, deadline,
                                                                   path, kind):
    script, args, write, where = PATHS[path]
    data = tmp_path / "data"
    data.mkdir()
    name = BAD[kind][0](data)
    write(data, name)
    code, line = run_cli(script, [*args, "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
                                  "--report_to", "none"], capsys)
    assert code == 2, line
    assert where in line and BAD[kind][1] in line, line


def test_the_pixel_limit_is_a_flag(tmp_path, capsys, no_model, no_vlm):
    data = tmp_path / "data"
    vision_rows(data, None)
    code, line = run_cli("grpo_vision", ["--model_name_or_path", "embedded-vlm", "--dataset_name", str(data),
                                         "--max_image_pixels", "1000", "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and "is 32 x 32 = 1024 pixels, over the limit of 1000" in line
    assert "raise --max_image_pixels" in line


def test_paths_outside_the_data_folder_are_read_when_allowed(tmp_path):
    from unialign.images import ImageRules
    from unialign.vision.media import load_image

    data = tmp_path / "data"
    data.mkdir()
    good_png(tmp_path, "shared.png")
    (data / "link.png").symlink_to(tmp_path / "shared.png")  # a link out of the folder is a way out too
    for value in ("../shared.png", "link.png", str(tmp_path / "shared.png")):
        with pytest.raises(ValueError, match="leads outside the data folder"):
            load_image(value, data, "row 0", ImageRules(data))
        assert load_image(value, data, "row 0", ImageRules(data, confine=False)).size == (32, 32)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["vision prompts", "image pairs"])
def test_skip_bad_rows_trains_on_the_rest_and_counts_them(tmp_path, path):
    script, args, write, _ = PATHS[path]
    data = tmp_path / "data"
    data.mkdir()
    write(data, BAD["truncated"][0](data))
    short = (["--max_steps", "1", "--num_eval", "2", "--prompts_per_step", "1", "--num_generations", "2",
              "--micro_batch_size", "2", "--eval_batch_size", "2"] if script == "grpo_vision" else
             ["--max_steps", "1", "--batch_size", "2", "--micro_batch_size", "2", "--num_eval", "2",
              "--num_eval_images", "2", "--eval_timestep_samples", "1"])
    summary = run(script, [*args, *short, "--dataset_name", str(data), "--skip_bad_rows", "true", "--report_to",
                           "none", "--output_dir", str(tmp_path / "out")])
    skipped = summary["bad_rows_skipped"]
    (source, record), = skipped.items()
    assert "train" in source and record["rows"] == 1 and "not a decodable image" in record["first"][0]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["bad_rows_skipped"] == skipped
