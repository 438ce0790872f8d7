"""Image grids with a caption and score under each image, saved as PNG (what a user looks at first)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont


def save_grid(images: list[Image.Image], captions: list[str], path: str | Path, columns: int = 8,
              cell: int = 128) -> Path:
    """Tile ``images`` (upscaled to ``cell`` px, nearest) with ``captions`` (wrapped) underneath each."""
    font = ImageFont.load_default()
    line_h, chars = 11, max(8, cell // 6)
    wrapped = [[c[i:i + chars] for i in range(0, len(c), chars)][:4] for c in captions]
    text_h = line_h * max((len(w) for w in wrapped), default=1) + 4
    rows = (len(images) + columns - 1) // columns
    grid = Image.new("RGB", (columns * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for k, (img, lines) in enumerate(zip(images, wrapped)):
        x, y = (k % columns) * cell, (k // columns) * (cell + text_h)
        grid.paste(img.convert("RGB").resize((cell, cell), Image.NEAREST), (x, y))
        for j, line in enumerate(lines):
            draw.text((x + 2, y + cell + 2 + j * line_h), line, fill="black", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path
