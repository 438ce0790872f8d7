"""Image grids with a caption under each image, saved as PNG (what a user looks at first)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

LINE_HEIGHT = 11
MAX_LINES = 4


def wrap_caption(caption: str, chars: int, max_lines: int = MAX_LINES) -> list[str]:
    """``caption`` in lines of at most ``chars`` characters, broken at spaces (a word longer than a line
    is split); at most ``max_lines`` lines, the last ending in "..." when text was cut."""
    lines = textwrap.wrap(caption, width=chars, break_long_words=True, break_on_hyphens=False) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][:max(0, chars - 3)].rstrip() + "..."
    return lines


def make_grid(images: list[Image.Image], captions: list[str], columns: int = 8, cell: int = 128) -> Image.Image:
    """Tile ``images`` (upscaled to ``cell`` px, nearest) with ``captions`` wrapped at word boundaries."""
    font = ImageFont.load_default()
    chars = max(8, cell // 6)
    wrapped = [wrap_caption(c, chars) for c in captions]
    text_h = LINE_HEIGHT * max((len(w) for w in wrapped), default=1) + 4
    rows = max(1, (len(images) + columns - 1) // columns)
    grid = Image.new("RGB", (columns * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for k, (img, lines) in enumerate(zip(images, wrapped)):
        x, y = (k % columns) * cell, (k // columns) * (cell + text_h)
        grid.paste(img.convert("RGB").resize((cell, cell), Image.NEAREST), (x, y))
        for j, line in enumerate(lines):
            draw.text((x + 2, y + cell + 2 + j * LINE_HEIGHT), line, fill="black", font=font)
    return grid


def save_grid(images: list[Image.Image], captions: list[str], path: str | Path, columns: int = 8,
              cell: int = 128) -> Image.Image:
    """``make_grid`` written to ``path`` (folders created); returns the grid."""
    grid = make_grid(images, captions, columns, cell)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return grid
