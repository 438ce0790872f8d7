"""Image preference data in Pick-a-Pic's schema, validated, and synthetic pairs labelled by a score.

Pick-a-Pic v2 rows: ``caption`` (str), ``jpg_0`` / ``jpg_1`` (encoded image bytes, PIL images, a path
to an image file -- relative paths are relative to the dataset file's folder, or the dataset folder --
or ``datasets``' image feature ``{"bytes": ..., "path": ...}``), ``label_0`` in {0, 0.5, 1} (1: image 0
preferred; 0.5: a tie). The original ``yuvalkirstain/pickapic_v2`` is gone from the Hub, so any dataset
(hub id, local .jsonl / .json / .parquet file or folder) with these columns works.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image


def _image(value: Any, root: Path | None = None) -> Image.Image:
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image feature, undecoded
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):  # a path to an image file
        path = Path(value).expanduser()
        path = path if path.is_absolute() or root is None else root / path
        if not path.is_file():
            raise FileNotFoundError(f"no image file {str(path)!r}")
        with Image.open(path) as img:
            return img.convert("RGB")
    if isinstance(value, (bytes, bytearray)):
        img = Image.open(io.BytesIO(value))
        img.load()
        return img.convert("RGB")
    raise TypeError(f"expected image bytes, a PIL image or an image path, got {type(value).__name__}")


def normalize_pickapic(rows: list[dict[str, Any]], source: str = "dataset",
                       root: str | Path | None = None) -> tuple[list[dict[str, Any]], int]:
    """Rows -> (pairs ``{"prompt", "chosen", "rejected"}`` with decoded PIL images, number of ties dropped).
    Image paths are read relative to ``root`` (default: the working directory). Raises ValueError naming
    the row and field of the first malformed row or unreadable image."""
    root = Path(root) if root is not None else None
    pairs, ties = [], 0
    for i, row in enumerate(rows):
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
            ties += 1
            continue
        images = []
        for field in ("jpg_0", "jpg_1"):
            try:
                images.append(_image(row[field], root))
            except Exception as err:  # noqa: BLE001 - PIL raises many types for corrupt data
                raise ValueError(f"{source} row {i}: field {field!r} is not a readable image ({err})") from None
        if not isinstance(row["caption"], str):
            raise ValueError(f"{source} row {i}: field 'caption' must be a string")
        chosen, rejected = images if label == 1.0 else images[::-1]
        pairs.append({"prompt": row["caption"], "chosen": chosen, "rejected": rejected})
    if not pairs:
        raise ValueError(f"{source}: no usable pairs ({ties} ties dropped)")
    return pairs, ties


def to_pixels(image: Image.Image, resolution: int) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """Resize the shortest side to ``resolution`` (bicubic), centre-crop a square; pixels in [-1, 1]
    [3, R, R], the original (h, w) and the crop's top-left (for SDXL's time_ids)."""
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
    """(train pairs, held-out pairs, ties dropped from training, info) of ``cfg.dataset_name`` (Hub id, file or
    folder) with ``unialign.data.train_eval_rows``'s held-out rules (``--eval_dataset_name``,
    ``--eval_split``, ``--eval_fraction``); at most ``cfg.num_eval`` held-out pairs."""
    from unialign.data import train_eval_rows

    train_rows, eval_rows, info = train_eval_rows(
        cfg.dataset_name, config_name=cfg.dataset_config, train_split=cfg.train_split, eval_split=cfg.eval_split,
        eval_name=cfg.eval_dataset_name, eval_fraction=cfg.eval_fraction)
    train, ties = normalize_pickapic(train_rows, "train", data_root(cfg.dataset_name))
    held_out, _ = normalize_pickapic(eval_rows, "eval", data_root(cfg.eval_dataset_name or cfg.dataset_name))
    return train, held_out[:cfg.num_eval], ties, info


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
