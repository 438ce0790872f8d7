"""Images a dataset names, checked before training: every one is opened and decoded once, up front, so a bad one is
one line naming its row and field before any model loads (or, with ``--skip_bad_rows``, its row is skipped and
counted), never a library's traceback at step 900.

What is checked (``open_checked``):

* **where it is**: a path must name a regular file (a FIFO would block the read forever, a device or a folder is no
  image) and, for data read from a folder or file, lie inside that folder once links are followed, unless
  ``--allow_image_paths_outside_data``;
* **how big it is**: at most ``--max_image_pixels`` (default: Pillow's decompression-bomb limit, 89.5 M pixels),
  read from the header before any pixel is decoded: a 20000 x 20000 PNG of a few kilobytes is refused without
  allocating its 1.2 GB;
* **that it decodes**: an empty or truncated file, or a mode the converters do not know, is refused
  (``decodes``: JPEGs are decoded at 1/8 scale, which still reads every byte of their entropy-coded data).

Pillow checks none of the first two by itself in a useful way: its bomb check is a warning up to twice its limit
and an exception past it, raised wherever the image happens to be opened.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unialign.config import arg
from unialign.errors import UserError

# modes the converters handle (unialign.image.data.to_rgb; PIL's convert("RGB") for the vision path)
MODES = ("1", "L", "P", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "LAB", "HSV", "LA", "La", "PA",
         "I", "I;16", "I;16L", "I;16B", "I;16N", "F")


@dataclass
class ImageDataArgs:
    """The image checks of scripts whose data sets name images (vision-language prompts and pairs, Pick-a-Pic)."""

    max_image_pixels: int | None = arg(
        None, "refuse a data set image larger than this many pixels (width x height, read from its header before "
              "decoding); unset: Pillow's decompression-bomb limit, 89.5 M", group="data", min=1)
    skip_bad_rows: bool = arg(
        False, "skip the rows whose image is unreadable, too large, not a file or outside the data folder, counted "
               "in the log and summary.json, instead of stopping with one line naming the first", group="data")
    allow_image_paths_outside_data: bool = arg(
        False, "let image paths (absolute, or through .. or a link) lead outside the data set's folder",
        group="data")


@dataclass
class ImageRules:
    """How ``open_checked`` judges one image: ``root`` (relative paths are read from it; with ``confine``, no path
    may lead outside it), the pixel limit (None: Pillow's ``MAX_IMAGE_PIXELS``)."""

    root: Path | None = None
    confine: bool = True
    max_pixels: int | None = None

    @classmethod
    def of(cls, cfg: Any, root: str | Path | None) -> ImageRules:
        """The rules a config's ``ImageDataArgs`` fields set for data read from ``root``."""
        return cls(Path(root) if root is not None else None,
                   confine=not getattr(cfg, "allow_image_paths_outside_data", False),
                   max_pixels=getattr(cfg, "max_image_pixels", None))

    def limit(self) -> int:
        from PIL import Image

        return int(self.max_pixels or Image.MAX_IMAGE_PIXELS or 2**62)


def image_path(value: str | os.PathLike, where: str, rules: ImageRules) -> Path:
    """The file a path in a row names, checked: it exists, is a regular file, and lies inside ``rules.root`` (links
    followed) when confined. ``UserError`` naming ``where``."""
    path = Path(value).expanduser()
    if not path.is_absolute() and rules.root is not None:
        path = rules.root / path
    try:
        st = os.stat(path)  # follows links; never opens, so a FIFO cannot block here
    except FileNotFoundError:
        raise UserError(f"{where}: no image file at {str(value)!r}"
                        + (f" (relative paths are read from {str(rules.root)!r})" if rules.root else "")) from None
    except OSError as err:
        raise UserError(f"{where}: cannot read the image path {str(value)!r} ({err.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device or socket")
        raise UserError(f"{where}: {str(value)!r} is {kind}, not an image file")
    if rules.confine and rules.root is not None:
        real, root = path.resolve(), rules.root.resolve()
        if real != root and root not in real.parents:
            raise UserError(f"{where}: {str(value)!r} leads outside the data folder {str(rules.root)!r} (to {real}); "
                            "pass --allow_image_paths_outside_data to read it")
    if st.st_size == 0:
        raise UserError(f"{where}: {str(value)!r} is an empty file (0 bytes)")
    return path


@contextlib.contextmanager
def _pillow_limit(pixels: int):
    """Pillow's own bomb check moved out of the way of ours (its warning and error at 1x / 2x its limit)."""
    from PIL import Image

    before = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = before


def open_checked(value: Any, where: str, rules: ImageRules | None = None):
    """``value`` (a PIL image, encoded bytes, datasets' ``{"bytes", "path"}``, or a path) opened lazily -- its
    header read, no pixel decoded -- after the checks of the module docstring (place, size, mode). Returns the
    PIL image; ``UserError`` naming ``where`` otherwise."""
    from PIL import Image, UnidentifiedImageError

    rules = rules or ImageRules(confine=False)
    if isinstance(value, Image.Image):
        _check_header(value, where, rules)
        return value
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image feature, undecoded
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) == 0:
            raise UserError(f"{where}: empty image bytes")
        source: Any = io.BytesIO(bytes(value))
    elif isinstance(value, (str, os.PathLike)):
        source = image_path(value, where, rules)
    else:
        raise UserError(f"{where}: an image must be a PIL image, bytes, {{'bytes', 'path'}} or a path, "
                        f"got {type(value).__name__}")
    try:
        with _pillow_limit(rules.limit()):
            image = Image.open(source)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise UserError(f"{where}: not a readable image ({type(err).__name__}: {str(err)[:200]})") from None
    _check_header(image, where, rules)
    return image


def _check_header(image, where: str, rules: ImageRules) -> None:
    w, h = image.size
    if w * h > rules.limit():
        raise UserError(f"{where}: the image is {w} x {h} = {w * h} pixels, over the limit of {rules.limit()} "
                        "(a decompression bomb, or an image to resize first); raise --max_image_pixels to allow it")
    if image.mode not in MODES:
        raise UserError(f"{where}: unsupported image mode {image.mode!r} (supported: {', '.join(MODES)})")


def decodes(image, where: str, rules: ImageRules | None = None, draft: bool = False):
    """Decode ``image`` (from ``open_checked``) to prove its data is whole, and return it: a truncated or corrupt
    file is a ``UserError`` naming ``where``. ``draft``: a JPEG is decoded at 1/8 scale (every byte read, about
    1/64 of the pixels), for a probe that is thrown away."""
    rules = rules or ImageRules(confine=False)
    try:
        with _pillow_limit(rules.limit()):
            if draft and image.format == "JPEG":
                image.draft(image.mode, (max(1, image.width // 8), max(1, image.height // 8)))
            image.load()
    except Exception as err:  # noqa: BLE001 - Pillow raises many types for corrupt data
        raise UserError(f"{where}: not a decodable image ({type(err).__name__}: {str(err)[:200]})") from None
    return image


def note_skipped(bad: list[str], total: int, source: str, info: dict | None) -> None:
    """Say how many of ``total`` rows of ``source`` were skipped for a bad image (``bad``: one line each), in the log
    and in ``info["bad_rows_skipped"]``; all of them is an error."""
    if not bad:
        return
    if len(bad) == total:
        raise UserError(f"{source}: every one of its {total} rows has a bad image (first: {bad[0]})")
    print(f"--skip_bad_rows: skipped {len(bad)} of {total} rows of {source} (first: {bad[0]})", flush=True)
    if info is not None:
        info.setdefault("bad_rows_skipped", {})[source] = {"rows": len(bad), "first": bad[:5]}
