"""The ``ocr`` reward (``unialign.rewards.ocr.OcrReward``, Flow-GRPO's text-rendering reward) on rendered images:
how its score behaves per image condition, and how fast it runs on one CPU core.

Images: 512x512 RGB (Flow-GRPO's SD3.5-M training resolution), drawn with PIL from the machine's TrueType
fonts, deterministic given ``seed``. Each image renders one phrase from ``PHRASES`` (1-3 words) and its
prompt quotes that phrase (``PROMPT_TEMPLATES``). Conditions (``CONDITIONS``):
  * ``clean``: large dark text (40-96 px high) on a plain light background;
  * ``rotated``: as clean, rotated by 15-30 degrees (either direction);
  * ``small``: as clean, the text 14-18 px high;
  * ``busy``: random coloured rectangles / ellipses plus pixel noise behind the text; the text is drawn with a
    contrasting outline, so it stays legible;
  * ``no_text``: a busy (even rows) or plain (odd rows) background with no text at all, while the prompt still
    asks for a phrase: the expected reward is ~0.
Per condition: mean, std, min, max of the reward over ``n_per_condition`` images and the fraction scoring 1,
and throughput in images/s with one thread everywhere (onnxruntime intra/inter-op 1, ``torch.set_num_threads(1)``,
``cv2.setNumThreads(1)``; as a script the process is also pinned to one CPU). Only the reward call is timed,
one image per call, after a warm-up call.

    .venv/bin/python -m benchmarks.ocr_reward [--n 40] [--seed 0] [--output /tmp/ocr.json] [--samples DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SIZE = 512  # Flow-GRPO trains SD3.5-M at 512x512 (its config/grpo.py resolution); outputs are that size
# Short phrases of the kind text-rendering prompts quote (signs, labels, shop fronts), 1-3 words; written for
# this benchmark, not taken from a data set. Letters, digits and a few common symbols only.
PHRASES = [
    "OPEN", "CLOSED", "EXIT", "STOP", "SALE", "HELLO", "WELCOME", "DANGER", "PUSH", "PULL",
    "COFFEE SHOP", "HELLO WORLD", "NO PARKING", "FRESH BREAD", "BOOK STORE", "GAME OVER", "THANK YOU",
    "BEST SELLER", "LIVE MUSIC", "FREE WIFI", "PIZZA", "HOTEL", "GARAGE", "BAKERY", "LIBRARY",
    "OPEN 24 HOURS", "HAPPY BIRTHDAY", "KEEP OUT", "FOR RENT", "SUMMER SALE", "NIGHT MARKET", "EAST GATE",
    "ROOM 42", "GATE B7", "ICE CREAM", "CITY PARK", "GOOD LUCK", "TEA HOUSE", "BUS STOP", "FLOWER SHOP",
]
# Prompt shapes in the style of Flow-GRPO's text-rendering prompts: a scene with the text in straight quotes
PROMPT_TEMPLATES = [
    'A sign that says "{}"',
    'A shop front with the words "{}" painted above the door',
    'A poster with the text "{}" in bold letters',
    'A neon sign reading "{}" on a brick wall',
    'A chalkboard with "{}" written on it',
]
CONDITIONS = ("clean", "rotated", "small", "busy", "no_text")
# Preferred fonts (DejaVu ships with most Linux images); any other TrueType font found is the fallback
PREFERRED_FONTS = ("DejaVuSans-Bold.ttf", "DejaVuSans.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSansCondensed-Bold.ttf",
                   "DejaVuSerif.ttf", "LiberationSans-Bold.ttf", "LiberationSans-Regular.ttf")
FONT_DIRS = ("/usr/share/fonts", "/usr/local/share/fonts", os.path.expanduser("~/.fonts"))
CLEAN_HEIGHT_PX = (40, 96)   # text height range of "clean" / "rotated" / "busy": large, as on a sign
SMALL_HEIGHT_PX = (14, 18)   # "small": about the height of small print on a 512 px image
ROTATION_DEG = (15.0, 30.0)  # "rotated": |angle| range
MAX_TEXT_WIDTH = 0.85        # fraction of the image width the text may take (a margin for the detector)


def find_fonts() -> list[str]:
    """Paths of the TrueType fonts to render with (list[str], non-empty): the ``PREFERRED_FONTS`` present under
    ``FONT_DIRS``, else every ``.ttf`` there except mono / light / oblique / italic / math faces (sorted).
    Raises RuntimeError when the machine has none (install fonts-dejavu-core)."""
    found = sorted({p for d in FONT_DIRS for p in glob.glob(os.path.join(d, "**", "*.ttf"), recursive=True)})
    by_name = {os.path.basename(p): p for p in found}
    preferred = [by_name[n] for n in PREFERRED_FONTS if n in by_name]
    if preferred:
        return preferred
    skip = ("mono", "light", "oblique", "italic", "math")
    rest = [p for p in found if not any(s in os.path.basename(p).lower() for s in skip)]
    if not rest:
        raise RuntimeError(f"no TrueType font under {', '.join(FONT_DIRS)} (e.g. apt-get install fonts-dejavu-core)")
    return rest


def _font_for_height(path: str, phrase: str, height: int, max_width: int):
    """The font at the largest size whose rendering of ``phrase`` is <= ``height`` px high and <= ``max_width``
    wide (text height = the ink box of the phrase), at least size 6."""
    from PIL import ImageFont

    size = max(6, height)
    while size > 6:
        font = ImageFont.truetype(path, size)
        left, top, right, bottom = font.getbbox(phrase)
        if bottom - top <= height and right - left <= max_width:
            return font
        size -= 1
    return ImageFont.truetype(path, 6)


def _light_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(v) for v in rng.integers(200, 256, 3))


def _dark_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(v) for v in rng.integers(0, 70, 3))


def busy_background(rng: np.random.Generator, size: int = SIZE):
    """A PIL RGB image [size, size]: a random mid-tone fill, 40-70 random coloured rectangles and ellipses,
    then Gaussian pixel noise (std 12 levels)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(60, 200, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(40, 71))):
        x0, y0 = (int(v) for v in rng.integers(-size // 4, size, 2))
        w, h = (int(v) for v in rng.integers(size // 16, size // 2, 2))
        shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
        shape((x0, y0, x0 + w, y0 + h), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    arr = np.asarray(image, dtype=np.float64) + rng.normal(0.0, 12.0, (size, size, 3))
    return Image.fromarray(np.clip(arr, 0, 255).round().astype(np.uint8), "RGB")


def render(condition: str, phrase: str, rng: np.random.Generator, fonts: list[str], index: int = 0):
    """One benchmark image: a PIL RGB image [SIZE, SIZE] of ``condition`` (module docstring) showing ``phrase``
    (nothing for ``no_text``; ``index`` picks its busy / plain background)."""
    from PIL import Image, ImageDraw

    if condition not in CONDITIONS:
        raise ValueError(f"condition must be one of {CONDITIONS}, got {condition!r}")
    if condition == "no_text":
        return busy_background(rng) if index % 2 == 0 else Image.new("RGB", (SIZE, SIZE), _light_colour(rng))
    font_path = fonts[int(rng.integers(len(fonts)))]
    low, high = SMALL_HEIGHT_PX if condition == "small" else CLEAN_HEIGHT_PX
    font = _font_for_height(font_path, phrase, int(rng.integers(low, high + 1)), int(MAX_TEXT_WIDTH * SIZE))
    left, top, right, bottom = font.getbbox(phrase)
    text_w, text_h = right - left, bottom - top
    if condition == "busy":
        image = busy_background(rng)
        fill = _dark_colour(rng) if rng.random() < 0.5 else _light_colour(rng)
        stroke = (255, 255, 255) if sum(fill) < 384 else (0, 0, 0)
        stroke_width = max(2, text_h // 12)
    else:
        image = Image.new("RGB", (SIZE, SIZE), _light_colour(rng))
        fill, stroke, stroke_width = _dark_colour(rng), None, 0
    if condition == "rotated":  # draw on a transparent layer, rotate it, paste it centred (with jitter)
        pad = 8
        layer = Image.new("RGBA", (text_w + 2 * pad, text_h + 2 * pad), (0, 0, 0, 0))
        ImageDraw.Draw(layer).text((pad - left, pad - top), phrase, font=font, fill=fill + (255,))
        angle = float(rng.uniform(*ROTATION_DEG)) * (1 if rng.random() < 0.5 else -1)
        layer = layer.rotate(angle, resample=Image.BICUBIC, expand=True)
        if layer.width > SIZE or layer.height > SIZE:  # never clip the rotated text
            layer.thumbnail((SIZE - 2 * pad, SIZE - 2 * pad), Image.LANCZOS)
        x = int(rng.integers(0, SIZE - layer.width + 1))
        y = int(rng.integers(0, SIZE - layer.height + 1))
        image.paste(layer, (x, y), layer)
        return image
    margin = stroke_width + 4
    x = int(rng.integers(margin, max(margin + 1, SIZE - text_w - margin))) - left
    y = int(rng.integers(margin, max(margin + 1, SIZE - text_h - margin))) - top
    ImageDraw.Draw(image).text((x, y), phrase, font=font, fill=fill, stroke_width=stroke_width, stroke_fill=stroke)
    return image


def make_condition(condition: str, n: int, seed: int = 0, fonts: list[str] | None = None):
    """``n`` (prompt, phrase, PIL image) triples of ``condition``; the same seed gives the same images."""
    fonts = fonts or find_fonts()
    rng = np.random.default_rng([seed, CONDITIONS.index(condition)])
    out = []
    for i in range(n):
        phrase = PHRASES[int(rng.integers(len(PHRASES)))]
        prompt = PROMPT_TEMPLATES[int(rng.integers(len(PROMPT_TEMPLATES)))].format(phrase)
        out.append((prompt, phrase, render(condition, phrase, rng, fonts, index=i)))
    return out


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:  # rapidocr needs cv2; without it OcrReward fails with the extra's message anyway
        pass


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("rapidocr_onnxruntime", "onnxruntime", "opencv-python", "numpy", "pillow"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def run(n_per_condition: int = 40, seed: int = 0, conditions: tuple[str, ...] = CONDITIONS,
        engine_kwargs: dict[str, Any] | None = None, samples_dir: str | None = None) -> dict:
    """Score ``n_per_condition`` images per condition with one ``OcrReward(num_threads=1)``.

    Returns a JSON-able dict: ``{"config": {...}, "versions": {...}, "machine": {...}, "conditions": {name:
    {"n", "mean", "std", "min", "max", "frac_one", "images_per_s", "median_s_per_image", "rewards"}}}``
    (std: population std over the n rewards; images_per_s = n / summed time of the n reward calls).
    ``samples_dir``: also save the first two images of every condition there as PNG (to look at).
    """
    from benchmarks.common import machine_info
    from unialign.rewards.ocr import OcrReward

    _one_thread()
    fonts = find_fonts()
    reward = OcrReward(num_threads=1, engine_kwargs=engine_kwargs)
    warm = make_condition("clean", 1, seed=seed + 1, fonts=fonts)[0]
    reward(prompts=[warm[0]], completions=[warm[2]])  # warm-up: onnxruntime's first run allocates
    results = {}
    for condition in conditions:
        rows = make_condition(condition, n_per_condition, seed=seed, fonts=fonts)
        if samples_dir:
            Path(samples_dir).mkdir(parents=True, exist_ok=True)
            for i, (_, phrase, image) in enumerate(rows[:2]):
                image.save(Path(samples_dir) / f"{condition}_{i}_{phrase.replace(' ', '_')}.png")
        rewards, seconds = [], []
        for prompt, _, image in rows:
            start = time.perf_counter()
            (score,) = reward(prompts=[prompt], completions=[image])
            seconds.append(time.perf_counter() - start)
            rewards.append(score)
        results[condition] = {
            "n": len(rewards), "mean": statistics.fmean(rewards), "std": statistics.pstdev(rewards),
            "min": min(rewards), "max": max(rewards), "frac_one": sum(r == 1.0 for r in rewards) / len(rewards),
            "images_per_s": len(seconds) / sum(seconds), "median_s_per_image": statistics.median(seconds),
            "rewards": rewards,
        }
    return {"config": {"n_per_condition": n_per_condition, "seed": seed, "size": SIZE, "fonts": fonts,
                       "engine_kwargs": engine_kwargs or {}, "num_threads": 1,
                       "use_angle_cls": reward.use_angle_cls, "min_confidence": reward.min_confidence},
            "versions": _versions(), "machine": machine_info(), "conditions": results}


def table(result: dict) -> str:
    """The markdown table of ``run``'s result: one row per condition."""
    lines = ["| condition | n | mean reward | std | frac = 1 | images/s (1 core) | median s/image |",
             "|---|---|---|---|---|---|---|"]
    for name, r in result["conditions"].items():
        lines.append(f"| {name} | {r['n']} | {r['mean']:.3f} | {r['std']:.3f} | {r['frac_one']:.2f} | "
                     f"{r['images_per_s']:.2f} | {r['median_s_per_image']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=40, help="images per condition (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated subset")
    parser.add_argument("--engine-kwargs", default=None, help='JSON for RapidOCR, e.g. {"det_limit_side_len": 960}')
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    parser.add_argument("--samples", default=None, help="save two images per condition as PNG in this folder")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU")
    args = parser.parse_args(argv)
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core: the throughput is per core
    conditions = tuple(c.strip() for c in args.conditions.split(",") if c.strip())
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        parser.error(f"unknown condition(s) {unknown}; choose from {CONDITIONS}")
    engine_kwargs = json.loads(args.engine_kwargs) if args.engine_kwargs else None
    start = time.perf_counter()
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result = run(args.n, args.seed, conditions, engine_kwargs, args.samples)
    result["seconds"] = time.perf_counter() - start
    result["date"] = date
    result["command"] = "python -m benchmarks.ocr_reward" + "".join(
        " " + shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    print(table(result))
    print(f"\n({result['seconds']:.0f} s; {result['versions']})")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
