"""Image preference pairs stay encoded until a batch is built: rows are checked without decoding pixels (one
clear error naming the row and field, before any model loads), fingerprinted by their encoded form, and decoded
one image at a time by ``preference_batch``."""

from __future__ import annotations

import io
import json
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from unialign.image.data import EncodedImage, load_pickapic, normalize_pickapic, to_pixels
from unialign.trainers.resume import data_fingerprint


def png(array_or_colour, size=(16, 16)) -> bytes:
    img = Image.fromarray(array_or_colour) if isinstance(array_or_colour, np.ndarray) else \
        Image.new("RGB", size, array_or_colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def noise(seed: int, size=(24, 20)) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)


@pytest.fixture
def no_decoding(monkeypatch):
    """Any pixel decode (``ImageFile.load``) fails the test."""
    def load(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def rows_on_disk(tmp_path, n=4):
    (tmp_path / "img").mkdir(exist_ok=True)
    rows = []
    for i in range(n):
        Image.fromarray(noise(i)).save(tmp_path / "img" / f"{i}.png")
        rows.append({"caption": f"c{i}", "jpg_0": f"img/{i}.png", "jpg_1": png(noise(100 + i)), "label_0": i % 2})
    return rows


def test_rows_are_checked_and_kept_encoded_without_decoding_pixels(tmp_path, monkeypatch):
    rows = rows_on_disk(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(ImageFile.ImageFile, "load", lambda self: (_ for _ in ()).throw(AssertionError("decoded")))
        pairs, ties = normalize_pickapic(rows, "train", tmp_path)
        data_fingerprint(pairs)  # the trainer's fingerprint needs no pixels either
    assert ties == 0 and all(isinstance(p[k], EncodedImage) for p in pairs for k in ("chosen", "rejected"))
    assert pairs[1]["chosen"].path == str(tmp_path / "img" / "1.png") and pairs[1]["chosen"].data is None
    assert pairs[1]["rejected"].data == rows[1]["jpg_1"]  # the row's own bytes, not a copy
    # decoded only when asked, to the same pixels
    assert np.array_equal(np.asarray(pairs[1]["chosen"].decode()), noise(1))
    assert np.array_equal(np.asarray(pairs[0]["chosen"].decode()), noise(100))  # label 0: image 1 wins


@pytest.mark.parametrize("bad, message", [
    (b"not an image", "cannot identify image file"),
    (png(noise(0))[:-30], "runcated"),  # truncated: the header reads, verify() does not
    (bytes(b ^ 0xFF if i == 200 else b for i, b in enumerate(png(noise(0)))), "broken PNG file"),
    ("img/missing.png", "no image file"),
    (12, "an image must be a PIL image, bytes, {'bytes', 'path'} or a path, got int"),
])
def test_unreadable_images_are_one_line_errors_naming_row_and_field(tmp_path, no_decoding, bad, message):
    rows = rows_on_disk(tmp_path, 2) if isinstance(bad, str) else [{"caption": "a", "jpg_0": png((1, 2, 3)),
                                                                    "jpg_1": png((4, 5, 6)), "label_0": 1}] * 2
    rows = [rows[0], {**rows[1], "jpg_1": bad}]
    with pytest.raises(ValueError, match=rf"train row 1: field 'jpg_1': .*{re.escape(message)}") as err:
        normalize_pickapic(rows, "train", tmp_path)
    assert "\n" not in str(err.value)


def test_unsupported_mode_is_refused_at_validation(monkeypatch, no_decoding):
    from unialign import images

    monkeypatch.setattr(images, "MODES", ("RGB",))  # as if greyscale were a mode to_rgb could not convert
    rows = [{"caption": "a", "jpg_0": png((1, 2, 3)), "jpg_1": png(np.zeros((4, 4), np.uint8)), "label_0": 1}]
    with pytest.raises(ValueError, match=r"row 0: field 'jpg_1': unsupported image mode 'L'"):
        normalize_pickapic(rows)


def test_fingerprint_is_stable_cheap_and_follows_the_files(tmp_path):
    rows = rows_on_disk(tmp_path)
    first = data_fingerprint(normalize_pickapic(rows, "train", tmp_path)[0])
    assert data_fingerprint(normalize_pickapic(rows, "train", tmp_path)[0]) == first  # another run, same data
    # moving the dataset folder keeps it (paths as the rows give them); rewriting an image file changes it
    moved = tmp_path / "moved"
    (tmp_path / "img").rename(moved.mkdir() or moved / "img")
    assert data_fingerprint(normalize_pickapic(rows, "train", moved)[0]) == first
    Image.fromarray(noise(7)).save(moved / "img" / "2.png")
    assert data_fingerprint(normalize_pickapic(rows, "train", moved)[0]) != first
    # bytes by their content: equal bytes, equal fingerprints; one changed byte, another
    a = [{"caption": "a", "jpg_0": png(noise(1)), "jpg_1": png(noise(2)), "label_0": 1}]
    b = [{"caption": "a", "jpg_0": png(noise(1)), "jpg_1": png(noise(3)), "label_0": 1}]
    copied = [{k: bytes(bytearray(v)) if isinstance(v, bytes) else v for k, v in a[0].items()}]
    assert data_fingerprint(normalize_pickapic(a)[0]) == data_fingerprint(normalize_pickapic(copied)[0])
    assert data_fingerprint(normalize_pickapic(a)[0]) != data_fingerprint(normalize_pickapic(b)[0])
    st = os.stat(moved / "img" / "2.png")
    assert str(normalize_pickapic(rows, "train", moved)[0][2]["rejected"]) == \
        f"EncodedImage(path='img/2.png', size={st.st_size}, mtime_ns={st.st_mtime_ns})"


def test_batches_decode_lazily_to_the_same_pixels_as_decoded_rows(make_policy, tmp_path):
    rows = rows_on_disk(tmp_path)
    lazy, _ = normalize_pickapic(rows, "train", tmp_path)
    decoded = [{**p, "chosen": p["chosen"].decode(), "rejected": p["rejected"].decode()} for p in lazy]
    for p, q in zip(lazy, decoded):
        for key in ("chosen", "rejected"):
            x, size, crop = to_pixels(p[key], 16)
            y, size2, crop2 = to_pixels(q[key], 16)
            assert torch.equal(x, y) and size == size2 == (24, 20) and crop == crop2
    policy = make_policy("sdxl")
    policy.generator.manual_seed(0)
    a = policy.preference_batch(lazy)
    policy.generator.manual_seed(0)
    b = policy.preference_batch(decoded)
    for key in ("latents", "time_ids"):
        assert torch.equal(a.chosen[key], b.chosen[key]) and torch.equal(a.rejected[key], b.rejected[key])


def test_an_image_gone_after_validation_is_named_when_its_batch_is_built(tmp_path):
    rows = rows_on_disk(tmp_path, 2)
    pairs, _ = normalize_pickapic(rows, "train", tmp_path)
    (tmp_path / "img" / "1.png").write_bytes(b"overwritten")
    with pytest.raises(ValueError, match=r"train row 1: field 'jpg_0' is not a readable image \(UnidentifiedImageError"):
        to_pixels(pairs[1]["chosen"], 16)


def test_load_pickapic_keeps_a_hub_datasets_image_columns_encoded(tmp_path, monkeypatch):
    import datasets

    import unialign.data as data

    rows = rows_on_disk(tmp_path, 6)
    table = {"caption": [r["caption"] for r in rows], "jpg_0": [str(tmp_path / r["jpg_0"]) for r in rows],
             "jpg_1": [r["jpg_1"] for r in rows], "label_0": [r["label_0"] for r in rows]}
    ds = datasets.Dataset.from_dict(table).cast_column("jpg_0", datasets.Image())
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, split=None, **kw: ds)
    monkeypatch.setattr(data, "require_hub", lambda name, kind="model", **kw: None)

    class Cfg:
        dataset_name, dataset_config, train_split, eval_split = "someone/pickapic", None, "train", None
        eval_dataset_name, eval_fraction, num_eval, encoding_errors = None, 0.1, 4, "strict"

    train, held_out, ties, info = load_pickapic(Cfg)
    assert len(train) == 6 and len(held_out) == 4 and ties == 0  # a Hub id: its "test" split (the same rows here)
    assert all(isinstance(p[k], EncodedImage) for p in train for k in ("chosen", "rejected"))
    got = train[1]["chosen"]  # label_0 = 1: jpg_0, a datasets Image feature kept as {"bytes", "path"}
    assert np.array_equal(np.asarray(got.decode()), noise(1))


def test_thousands_of_large_pairs_are_checked_without_decoding(no_decoding):
    """2000 pairs of 512x512 PNGs (solid colours: ~1 KB encoded, 768 KB decoded each): checked, never decoded."""
    data = [png((i % 256, 7, 9), (512, 512)) for i in range(8)]
    rows = [{"caption": f"{i}", "jpg_0": data[i % 8], "jpg_1": data[(i + 1) % 8], "label_0": 1} for i in range(2000)]
    pairs, _ = normalize_pickapic(rows)
    assert len(pairs) == 2000 and all(p["chosen"].data is data[i % 8] for i, p in enumerate(pairs))


def test_pickapic_rows_as_json_paths_end_to_end(tmp_path, no_decoding):
    rows = rows_on_disk(tmp_path, 10)
    for r in rows:
        r["jpg_1"] = r["jpg_0"]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    class Cfg:
        dataset_name, dataset_config, train_split, eval_split = str(tmp_path / "pairs.jsonl"), None, "train", None
        eval_dataset_name, eval_fraction, num_eval, encoding_errors = None, 0.2, 4, "strict"

    train, held_out, ties, info = load_pickapic(Cfg)
    assert len(train) + len(held_out) == 10 and all(p["chosen"].path for p in train)


def test_a_tie_in_the_held_out_split_is_counted(tmp_path):
    """A tie is dropped from either split; the held-out split's are counted too (``eval_ties_dropped``), so a
    run that dropped a pair never reports none."""
    import json

    rows = [{**r, "jpg_1": r["jpg_0"].replace(".png", "b.png")} for r in rows_on_disk(tmp_path, 6)]
    for i in range(6):
        Image.fromarray(noise(100 + i)).save(tmp_path / "img" / f"{i}b.png")
    rows[5]["label_0"] = 0.5
    for name, part in (("train", rows[:4]), ("test", rows[4:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))

    class Cfg:
        dataset_name, dataset_config, train_split, eval_split = str(tmp_path), None, "train", None
        eval_dataset_name, eval_fraction, num_eval, encoding_errors = None, 0.1, 4, "strict"

    train, held_out, ties, info = load_pickapic(Cfg)
    assert (len(train), len(held_out), ties, info["eval_ties_dropped"]) == (4, 1, 0, 1)
