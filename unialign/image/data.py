"""Image preference data in Pick-a-Pic's schema, validated, and synthetic pairs labelled by a score.

Pick-a-Pic v2 rows: ``caption`` (str), ``jpg_0`` / ``jpg_1`` (encoded image bytes, PIL images, a path
to an image file -- relative paths are relative to the dataset file's folder, or the dataset folder --
or ``datasets``' image feature ``{"bytes": ..., "path": ...}``), ``label_0`` in {0, 0.5, 1} (1: image 0
preferred; 0.5: a tie). The original ``yuvalkirstain/pickapic_v2`` is gone from the Hub, so any dataset
(hub id, local .jsonl / .json / .parquet file or folder) with these columns works.

Images stay encoded until a batch needs them: ``normalize_pickapic`` checks each image cheaply (its header,
and ``verify()`` -- chunk checksums, no pixel decoding) and keeps an ``EncodedImage`` (the file's bytes, or
its path); ``to_pixels`` decodes, converts (``to_rgb``) and resizes one image at a time when
``preference_batch`` builds a batch. Memory is the encoded rows (bytes held in the dataset, or ~100 bytes per
path) plus one decoded image, whatever the dataset's length.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from unialign.errors import UserError
from unialign.images import ImageRules, decodes, note_skipped, open_checked

# MODES (unialign.images): the modes ``to_rgb`` converts; anything else is refused by name at validation
WHITE = (255, 255, 255)


class EncodedImage:
    """One image of a dataset row kept encoded: its file ``data`` (bytes) or ``path``; decoded by ``decode()``.

    ``str(image)`` (what ``unialign.trainers.resume.data_fingerprint`` hashes for objects it does not know)
    identifies the content without decoding it: the SHA-256 of the bytes, or for a file the path as the row
    gives it, its size and its modification time (``os.stat``, taken when the row was checked) -- so the
    fingerprint is stable from run to run, cheap (no file is read for it), and changes when a file is
    rewritten (or copied without its times: ``cp -p`` / ``rsync -a`` keep them)."""

    __slots__ = ("data", "path", "where", "_key")

    def __init__(self, data: bytes | None = None, path: str | os.PathLike | None = None, where: str = "image",
                 key: str | None = None):
        if (data is None) == (path is None):
            raise ValueError("EncodedImage: give exactly one of data (bytes) and path")
        self.data = bytes(data) if isinstance(data, bytearray) else data
        self.path = None if path is None else str(path)
        self.where, self._key = where, key

    def open(self) -> Image.Image:
        """The lazily opened PIL image (header read; pixels decoded on first use)."""
        return Image.open(io.BytesIO(self.data) if self.data is not None else self.path)

    def decode(self) -> Image.Image:
        """The decoded image, in the file's own mode (``to_rgb`` converts it); ValueError naming the row and field
        when the file can no longer be read."""
        try:
            img = self.open()
            try:
                img.load()
            except BaseException:
                img.close()
                raise
        except Exception as err:  # noqa: BLE001 - PIL raises many types for corrupt data
            raise ValueError(f"{self.where} is not a readable image ({type(err).__name__}: {err})") from None
        if getattr(img, "fp", None) is not None:  # a multi-frame file stays open: keep the frame, close the file
            frame = img.copy()
            img.close()
            return frame
        return img

    def __str__(self) -> str:
        if self._key is None:
            if self.data is not None:
                self._key = f"EncodedImage(sha256={hashlib.sha256(self.data).hexdigest()}, {len(self.data)} bytes)"
            else:
                st = os.stat(self.path)
                self._key = f"EncodedImage(path={self.path!r}, size={st.st_size}, mtime_ns={st.st_mtime_ns})"
        return self._key

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EncodedImage) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


def _checked(value: Any, where: str, rules: ImageRules) -> EncodedImage | Image.Image:
    """``value`` as an ``EncodedImage`` (a PIL image as it is) after ``unialign.images``' checks: a regular file
    inside the data folder (unless allowed outside), at most the pixel limit, a mode ``to_rgb`` converts, and
    whole: a PNG by ``verify()`` (every chunk's checksum, no pixel decoded), any other format by a probe decode
    (a JPEG at 1/8 scale)."""
    if isinstance(value, EncodedImage):
        return value
    image = open_checked(value, where, rules)
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image feature, undecoded
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (str, os.PathLike)):
        path = Path(image.filename)
        st = path.stat()
        encoded = EncodedImage(path=path, where=where,
                               key=f"EncodedImage(path={str(value)!r}, size={st.st_size}, mtime_ns={st.st_mtime_ns})")
    else:
        encoded = EncodedImage(data=bytes(value), where=where)
    with image:
        try:
            image.verify()
        except Exception as err:  # noqa: BLE001 - PIL raises many types for corrupt data
            raise UserError(f"{where}: not a readable image ({type(err).__name__}: {str(err)[:200]})") from None
    if image.format != "PNG":  # PNG's verify() read every chunk and its checksum; others must decode to tell
        with encoded.open() as probe:  # (verify() leaves the image unusable: a fresh one)
            decodes(probe, where, rules, draft=True)
    return encoded


def to_rgb(image: Image.Image, background: tuple[int, int, int] = WHITE) -> Image.Image:
    """``image`` as 8-bit RGB, each mode by its meaning (``image`` itself when it is RGB already):

    * 16-bit greyscale (``I;16*``, and ``I``, which Pillow uses for 16-bit data): 0..65535 scaled to 0..255
      (rounded; ``I`` clipped to that range). PIL's own ``convert("RGB")`` clips these at 255 (all white).
    * ``F`` (float): values in [0, 1] scaled by 255; otherwise taken as 0..255 (clipped, NaN as 0).
    * with transparency (``RGBA``, ``LA``, ``PA``, premultiplied ``RGBa`` / ``La``, ``P`` / ``L`` / ``RGB``
      with a ``transparency`` entry): composited over ``background`` (white, as ``transformers``'
      ``convert_to_rgb``), not dropped (which shows whatever colour transparent pixels happen to hold).
    * ``LAB`` through LittleCMS (Lab D50 -> sRGB); ``1``, ``L``, ``P``, ``CMYK`` (no ICC profile: Pillow's
      ``(255 - C)(255 - K) / 255``), ``YCbCr``, ``HSV``, ``RGBX`` as Pillow converts them.
    ICC profiles are ignored (as Pillow does)."""
    mode = image.mode
    if mode == "RGB" and "transparency" not in image.info:
        return image
    if mode.startswith("I;16") or mode == "I":
        grey = np.asarray(image).astype(np.int64)
        grey = ((np.clip(grey, 0, 65535) * 255 + 32767) // 65535).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if mode == "F":
        x = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        if x.size and x.min() >= 0.0 and x.max() <= 1.0:
            x = x * 255.0
        return Image.fromarray(np.clip(np.rint(x), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in ("RGBa", "La"):  # premultiplied alpha: over a background b, C = C_premultiplied + (1 - a) b
        x = np.asarray(image).astype(np.int64)
        colour, alpha = x[..., :-1], x[..., -1:]
        if mode == "La":
            colour = np.repeat(colour, 3, axis=-1)
        out = colour + ((255 - alpha) * np.asarray(background) + 127) // 255
        return Image.fromarray(np.clip(out, 0, 255).astype(np.uint8), "RGB")
    if mode == "LAB":
        from PIL import ImageCms

        lab_to_srgb = ImageCms.buildTransform(ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"),
                                              "LAB", "RGB")
        return ImageCms.applyTransform(image, lab_to_srgb)
    if mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*background, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def normalize_pickapic(rows: list[dict[str, Any]], source: str = "dataset", root: str | Path | None = None,
                       rules: ImageRules | None = None,
                       bad_rows: list[str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Rows -> (pairs ``{"prompt", "chosen", "rejected"}``, number of ties dropped). ``chosen`` / ``rejected``
    are ``EncodedImage``s (images given as bytes, paths or ``{"bytes", "path"}``; decoded per batch by
    ``to_pixels``) or the PIL images the rows held. Image paths are read relative to ``root`` (default: the
    working directory; ``rules``: ``unialign.images.ImageRules``, by default unconfined with Pillow's pixel limit).
    Raises ValueError naming the row and field of the first malformed row or bad image (``_checked``), or -- with
    a ``bad_rows`` list -- appends each such row's line to it and skips the row."""
    root = Path(root) if root is not None else None
    rules = rules or ImageRules(root, confine=False)
    pairs, ties = [], 0
    for i, row in enumerate(rows):
        try:
            pair = _pair(row, i, source, rules)
        except UserError as err:  # an image's problem (a row's schema is not skipped)
            if bad_rows is None:
                raise
            bad_rows.append(str(err))
            continue
        if pair is None:
            ties += 1
        else:
            pairs.append(pair)
    if not pairs:
        raise ValueError(f"{source}: no usable pairs ({ties} ties dropped)")
    return pairs, ties


def _pair(row: dict[str, Any], i: int, source: str, rules: ImageRules) -> dict[str, Any] | None:
    """One Pick-a-Pic row as a pair, or None for a tie."""
    for field in ("caption", "jpg_0", "jpg_1", "label_0"):
        if field not in row:
            raise ValueError(f"{source} row {i}: missing field {field!r} (keys: {sorted(row)})")
    try:
        label = float(row["label_0"])
    except (TypeError, ValueError):
        raise ValueError(f"{source} row {i}: field 'label_0' must be 0, 0.5 or 1, got {row['label_0']!r}") from None
    if label not in (0.0, 0.5, 1.0):
        raise ValueError(f"{source} row {i}: field 'label_0' must be 0, 0.5 or 1, got {label}")
    if label == 0.5:
        return None
    if not isinstance(row["caption"], str):
        raise ValueError(f"{source} row {i}: field 'caption' must be a string")
    images = [_checked(row[field], f"{source} row {i}: field {field!r}", rules) for field in ("jpg_0", "jpg_1")]
    chosen, rejected = images if label == 1.0 else images[::-1]
    return {"prompt": row["caption"], "chosen": chosen, "rejected": rejected}


def to_pixels(image: Image.Image | EncodedImage, resolution: int) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """Decode (an ``EncodedImage``; only now), convert to RGB (``to_rgb``), resize the shortest side to
    ``resolution`` (bicubic), centre-crop a square; pixels in [-1, 1] [3, R, R], the original (h, w) and the
    crop's top-left (for SDXL's time_ids). The decoded full-size image is released on return."""
    image = to_rgb(image.decode() if isinstance(image, EncodedImage) else image)
    w, h = image.size
    scale = resolution / min(w, h)
    nw, nh = max(resolution, round(w * scale)), max(resolution, round(h * scale))
    resized = image.resize((nw, nh), Image.BICUBIC)
    top, left = (nh - resolution) // 2, (nw - resolution) // 2
    crop = resized.crop((left, top, left + resolution, top + resolution))
    x = torch.frombuffer(bytearray(crop.tobytes()), dtype=torch.uint8).view(resolution, resolution, 3)
    return x.permute(2, 0, 1).float() / 127.5 - 1.0, (h, w), (top, left)


def data_root(name: str) -> Path:
    """The folder relative image paths of dataset ``name`` are read from: the folder itself, or a file's folder."""
    path = Path(name).expanduser()
    return path if path.is_dir() else path.parent


def load_pickapic(cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int, dict[str, Any]]:
    """(train pairs, held-out pairs, ties dropped from training, info: ``eval_ties_dropped`` the held-out split's) of
    ``cfg.dataset_name`` (Hub id, file or
    folder) with ``unialign.data.train_eval_rows``'s held-out rules (``--eval_dataset_name``,
    ``--eval_split``, ``--eval_fraction``); at most ``cfg.num_eval`` held-out pairs. Images stay encoded
    (``EncodedImage``; a Hub dataset's ``Image`` columns are read undecoded) until a batch needs them."""
    from unialign.data import train_eval_rows

    train_rows, eval_rows, info = train_eval_rows(
        cfg.dataset_name, config_name=cfg.dataset_config, train_split=cfg.train_split, eval_split=cfg.eval_split,
        eval_name=cfg.eval_dataset_name, eval_fraction=cfg.eval_fraction, decode_images=False,
        encoding_errors=getattr(cfg, "encoding_errors", "strict"))
    bad: dict[str, list[str] | None] = {k: [] if getattr(cfg, "skip_bad_rows", False) else None
                                        for k in ("train", "eval")}
    roots = {"train": data_root(cfg.dataset_name), "eval": data_root(cfg.eval_dataset_name or cfg.dataset_name)}
    train, ties = normalize_pickapic(train_rows, "train", roots["train"], _rules(cfg, roots["train"]), bad["train"])
    held_out, eval_ties = normalize_pickapic(eval_rows, "eval", roots["eval"], _rules(cfg, roots["eval"]), bad["eval"])
    info["eval_ties_dropped"] = eval_ties  # a tie in the held-out split is dropped too: counted, not lost
    for split, n in (("train", len(train_rows)), ("eval", len(eval_rows))):
        note_skipped(bad[split] or [], n, split, info)
    return train, held_out[:cfg.num_eval], ties, info


def _rules(cfg: Any, root: Path) -> ImageRules:
    """The image rules of ``cfg`` for data under ``root`` (a local folder; a Hub dataset's images are bytes)."""
    return ImageRules.of(cfg, root if root.exists() else None)


@torch.no_grad()
def synthetic_pairs(policy, prompts: list[str], score: Callable[[list[Image.Image]], torch.Tensor],
                    pairs_per_prompt: int, seed: int, min_gap: float = 0.0) -> list[dict[str, Any]]:
    """AI-feedback pairs in Pick-a-Pic's schema: two samples of ``policy`` per caption, ``label_0`` from
    ``score`` (higher wins; ties when the gap is below ``min_gap``). Images are stored as PNG bytes."""
    gen = torch.Generator().manual_seed(seed)
    batch = [p for p in prompts for _ in range(pairs_per_prompt)]
    a = policy.sample(batch, generator=gen).completions
    b = policy.sample(batch, generator=gen).completions
    sa, sb = score(a), score(b)
    rows = []
    for caption, ia, ib, x, y in zip(batch, a, b, sa.tolist(), sb.tolist()):
        label = 0.5 if abs(x - y) < min_gap else float(x > y)
        rows.append({"caption": caption, "jpg_0": _png(ia), "jpg_1": _png(ib), "label_0": label})
    return rows


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
