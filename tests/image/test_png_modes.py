"""Every image mode becomes the right 8-bit RGB (``unialign.image.data.to_rgb``), on hand-made images: 16-bit
greyscale is scaled, not clipped to white; transparency is composited over white; floats in [0, 1] scaled."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from unialign.image.data import EncodedImage, normalize_pickapic, to_pixels, to_rgb


def rgb(img: Image.Image) -> np.ndarray:
    out = to_rgb(img)
    assert out.mode == "RGB" and out.size == img.size
    return np.asarray(out)


def grey(values) -> list[tuple[int, int, int]]:
    return [(v, v, v) for v in values]


def as_png(img: Image.Image, **kw) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return EncodedImage(data=buf.getvalue()).decode()


def test_16_bit_greyscale_is_scaled_to_8_bits():
    values = np.array([[0, 128, 257, 32768, 40000, 65535]], dtype=np.uint16)
    img = Image.fromarray(values)
    assert img.mode == "I;16"
    assert (np.asarray(img.convert("RGB"))[0, 2:] == 255).all()  # PIL clips at 255: all white
    want = grey([0, 0, 1, 128, 156, 255])  # round(v / 257)
    assert [tuple(p) for p in rgb(img)[0]] == want
    png16 = as_png(img)  # a real 16-bit greyscale PNG file, as Pillow reads it
    assert png16.mode == "I;16" and [tuple(p) for p in rgb(png16)[0]] == want
    big_endian = Image.frombytes("I;16B", (6, 1), values.astype(">u2").tobytes())
    assert [tuple(p) for p in rgb(big_endian)[0]] == want
    # mode I (32-bit ints, Pillow's older mode for 16-bit data): the 16-bit range, clipped
    wide = Image.fromarray(np.array([[-5, 0, 257, 65535, 70000]], dtype=np.int32))
    assert wide.mode == "I" and [tuple(p) for p in rgb(wide)[0]] == grey([0, 0, 1, 255, 255])
    # and through the training path: pixels in [-1, 1] from the 16-bit values
    x, _, _ = to_pixels(EncodedImage(data=_png_bytes(Image.fromarray(np.full((8, 8), 32768, np.uint16)))), 4)
    assert float(x.min()) == float(x.max()) == pytest.approx(128 / 127.5 - 1, abs=1e-6)


def _png_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def test_float_images():
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0, np.nan]], dtype=np.float32))
    assert [tuple(p) for p in rgb(unit)[0]] == grey([0, 128, 255, 0])  # PIL: 0, 0, 1, ...
    wide = Image.fromarray(np.array([[0.0, 100.0, 300.0, -4.0]], dtype=np.float32))
    assert [tuple(p) for p in rgb(wide)[0]] == grey([0, 100, 255, 0])


def test_transparency_is_composited_over_white():
    la = Image.new("LA", (3, 1))
    la.putdata([(100, 0), (100, 255), (100, 128)])
    assert [tuple(p) for p in rgb(la)[0]] == grey([255, 100, round(100 * 128 / 255 + 255 * 127 / 255)])
    assert [tuple(p) for p in rgb(as_png(la))[0]] == [tuple(p) for p in rgb(la)[0]]
    rgba = Image.new("RGBA", (2, 1))
    rgba.putdata([(10, 20, 30, 0), (10, 20, 30, 255)])
    assert [tuple(p) for p in rgb(rgba)[0]] == [(255, 255, 255), (10, 20, 30)]
    # a palette with a transparent entry (GIF / PNG tRNS): transparent pixels white, the rest their colour
    p = Image.new("P", (2, 1))
    p.putpalette([0, 0, 0, 255, 0, 0])
    p.putdata([0, 1])
    p_png = as_png(p, transparency=0)
    assert p_png.mode == "P" and p_png.info.get("transparency") == 0
    assert [tuple(c) for c in rgb(p_png)[0]] == [(255, 255, 255), (255, 0, 0)]
    assert [tuple(c) for c in rgb(as_png(p))[0]] == [(0, 0, 0), (255, 0, 0)]  # no transparency: as is
    # greyscale / RGB with a tRNS colour key
    key = as_png(Image.new("L", (1, 1), 50), transparency=50)
    assert key.mode == "L" and [tuple(c) for c in rgb(key)[0]] == [(255, 255, 255)]
    # premultiplied alpha: colour + (1 - alpha) * white
    rgba_pm = Image.frombytes("RGBa", (1, 1), bytes([50, 0, 25, 128]))
    assert [tuple(c) for c in rgb(rgba_pm)[0]] == [(50 + 127, 127, 25 + 127)]
    la_pm = Image.frombytes("La", (1, 1), bytes([50, 128]))
    assert [tuple(c) for c in rgb(la_pm)[0]] == [(177, 177, 177)]


def test_cmyk_bilevel_lab_and_plain_modes():
    cmyk = Image.new("CMYK", (3, 1))
    cmyk.putdata([(0, 0, 0, 0), (255, 0, 0, 0), (100, 50, 0, 60)])
    want = [(255, 255, 255), (0, 255, 255), tuple(round((255 - c) * (255 - 60) / 255) for c in (100, 50, 0))]
    assert [tuple(c) for c in rgb(cmyk)[0]] == want
    one = Image.new("1", (2, 1))
    one.putdata([0, 255])
    assert [tuple(c) for c in rgb(one)[0]] == [(0, 0, 0), (255, 255, 255)]
    assert [tuple(c) for c in rgb(as_png(one))[0]] == [(0, 0, 0), (255, 255, 255)]
    lab = rgb(Image.new("LAB", (1, 1), (128, 128, 128)))[0, 0]  # L* 50, a* = b* = 0: a neutral mid grey
    assert lab[0] == lab[1] == lab[2] and 100 < lab[0] < 140  # PIL's plain convert gives a colour
    img = Image.new("RGB", (2, 2), (1, 2, 3))
    assert to_rgb(img) is img  # RGB: no copy
    assert [tuple(c) for c in rgb(Image.new("L", (1, 1), 77))[0]] == [(77, 77, 77)]


def test_non_rgb_pairs_train_with_their_converted_pixels():
    rows = [{"caption": "a", "jpg_0": _png_bytes(Image.fromarray(np.full((4, 4), 65535, np.uint16))),
             "jpg_1": _png_bytes(Image.new("LA", (4, 4), (0, 0))), "label_0": 1}]
    pair = normalize_pickapic(rows)[0][0]
    assert pair["chosen"].decode().mode == "I;16" and pair["rejected"].decode().mode == "LA"
    for side in ("chosen", "rejected"):  # both white: 16-bit full scale, and fully transparent
        x, _, _ = to_pixels(pair[side], 4)
        assert float(x.min()) == float(x.max()) == 1.0
