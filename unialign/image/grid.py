"""Image grids with a caption under each image, saved as PNG (what a user looks at first): ``make_grid`` (one
set of images, the trackers' held-out grid) and ``make_comparison`` (the run's ``comparison.png``: the same
held-out prompts and seeds before and after training, side by side, with a legend and readable captions)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from unialign.files import write_with

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


def is_video(sample) -> bool:
    """Whether a completion is a video (a list / tuple of frames) rather than one image."""
    return isinstance(sample, (list, tuple))


def video_strip(frames: list[Image.Image], frame_px: int | None = None, gap: int = 2) -> Image.Image:
    """A video's frames side by side, left to right in time, ``gap`` white pixels apart; each frame upscaled
    (nearest) or shrunk (Lanczos) to ``frame_px`` px high (None: as it is)."""
    frames = [f.convert("RGB") for f in frames]
    w0, h0 = frames[0].size
    size = (w0, h0) if frame_px is None else (max(1, round(frame_px * w0 / h0)), frame_px)
    resample = Image.NEAREST if size[1] >= h0 else Image.LANCZOS
    strip = Image.new("RGB", (len(frames) * (size[0] + gap) - gap, size[1]), "white")
    for k, frame in enumerate(frames):
        strip.paste(frame.resize(size, resample), (k * (size[0] + gap), 0))
    return strip


def make_grid(images: list, captions: list[str], columns: int = 8, cell: int = 128) -> Image.Image:
    """Tile ``images`` (upscaled to ``cell`` px, nearest) with ``captions`` wrapped at word boundaries. Videos
    (lists of frames) are tiled as their ``video_strip`` of ``cell // 2`` px frames, as many to a row as fit
    ``columns`` image cells."""
    if images and is_video(images[0]):
        images = [video_strip(v, cell // 2) for v in images]
        width, height = images[0].size
        columns = max(1, columns * cell // width)
    else:
        width = height = cell
    font = ImageFont.load_default()
    chars = max(8, width // 6)
    wrapped = [wrap_caption(c, chars) for c in captions]
    text_h = LINE_HEIGHT * max((len(w) for w in wrapped), default=1) + 4
    rows = max(1, (len(images) + columns - 1) // columns)
    grid = Image.new("RGB", (columns * width, rows * (height + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for k, (img, lines) in enumerate(zip(images, wrapped)):
        x, y = (k % columns) * width, (k // columns) * (height + text_h)
        grid.paste(img.convert("RGB").resize((width, height), Image.NEAREST), (x, y))
        for j, line in enumerate(lines):
            draw.text((x + 2, y + height + 2 + j * LINE_HEIGHT), line, fill="black", font=font)
    return grid


def save_grid(images: list[Image.Image], captions: list[str], path: str | Path, columns: int = 8,
              cell: int = 128) -> Image.Image:
    """``make_grid`` written to ``path`` (folders created); returns the grid."""
    grid = make_grid(images, captions, columns, cell)
    write_with(path, grid.save, f"the image grid {path}")
    return grid


COMPARISON_FONT_SIZE = 16  # px; Pillow's bitmap default is ~7 px high (11 px a line), too small to read at a glance
MAX_COMPARISON_PROMPTS = 32


def caption_font(size: int = COMPARISON_FONT_SIZE):
    """Pillow's bundled scalable font at ``size`` px (``ImageFont.load_default(size=...)``: Pillow >= 10.1 with
    FreeType); an older Pillow gives its fixed bitmap font."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: no size argument
        return ImageFont.load_default()


def _line_height(font) -> int:
    """Pixels from one text line to the next in ``font`` (ascent + descent + 2 px)."""
    if hasattr(font, "getmetrics"):
        ascent, descent = font.getmetrics()
        return ascent + descent + 2
    return font.getbbox("Ag")[3] + 3


def wrap_to_width(text: str, font, width: int, max_lines: int) -> list[str]:
    """``wrap_caption`` of ``text`` in lines that fit ``width`` pixels of ``font`` (at most ``max_lines``)."""
    chars = max(8, int(width * 26 / max(1.0, font.getlength("abcdefghijklmnopqrstuvwxyz"))))
    lines = wrap_caption(text, chars, max_lines)
    while chars > 8 and any(font.getlength(line) > width for line in lines):
        chars -= 1
        lines = wrap_caption(text, chars, max_lines)
    return lines


def first_of_each_prompt(prompts: list[str], limit: int = MAX_COMPARISON_PROMPTS) -> list[int]:
    """Indices of the first image of each distinct prompt, in order, at most ``limit`` (held-out prompts are
    cycled over the images: these are the first ``limit`` prompts of the held-out set)."""
    seen: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        if len(seen) >= limit:
            break
        seen.setdefault(prompt, i)
    return list(seen.values())


def _check_lengths(what: str, kind: str, before: list, after: list, prompts: list[str],
                   before_labels: list[str] | None, after_labels: list[str] | None) -> None:
    """ValueError naming ``what`` unless there is one before and one after sample (and label) per prompt, at least
    one."""
    n = len(prompts)
    if not n or len(before) != n or len(after) != n:
        raise ValueError(f"{what}: {len(before)} before / {len(after)} after {kind} for {n} prompts "
                         "(one of each per prompt, at least one)")
    for labels, side in ((before_labels, "before"), (after_labels, "after")):
        if labels is not None and len(labels) != n:
            raise ValueError(f"{what}: {len(labels)} {side} labels for {n} prompts")


def _pair_captions(keep: list[int], prompts: list[str], before_labels: list[str] | None,
                   after_labels: list[str] | None, font, width: int, prompt_lines: int) -> list[tuple[list, list]]:
    """(prompt lines, score lines) of each kept pair: the prompt in at most ``prompt_lines`` lines and
    "before <label>  |  after <label>" in at most two, both fitting ``width`` pixels of ``font``."""
    out = []
    for i in keep:
        scores = "  |  ".join(f"{side} {labels[i]}" for side, labels in (("before", before_labels),
                                                                          ("after", after_labels))
                              if labels is not None and labels[i])
        out.append((wrap_to_width(prompts[i], font, width, prompt_lines),
                    wrap_to_width(scores, font, width, 2) if scores else []))
    return out


def make_comparison(before: list[Image.Image], after: list[Image.Image], prompts: list[str],
                    before_labels: list[str] | None = None, after_labels: list[str] | None = None,
                    title: str = "", columns: int = 4, cell: int = 192, max_prompts: int = MAX_COMPARISON_PROMPTS,
                    font_size: int = COMPARISON_FONT_SIZE) -> Image.Image:
    """One before/after image: for each of the first ``max_prompts`` distinct prompts (``first_of_each_prompt``;
    image i of ``before`` and ``after`` must be the same prompt and seed) its before and after image side by side,
    ``cell`` px wide each (nearest-neighbour when upscaled, Lanczos when shrunk), the prompt and the per-image
    labels (e.g. "before 0.12 ok | after 0.56 ok") under the pair; ``columns`` pairs to a row; a header with
    ``title`` and a "before" / "after" legend over every column. Text is ``font_size`` px (``caption_font``).
    The tiling is diffusers' ``make_image_grid``; the captions, legend and gutters are drawn here, which it
    does not do. ValueError when the lists differ in length or are empty."""
    from diffusers.utils import make_image_grid
    from PIL import ImageOps

    _check_lengths("make_comparison", "images", before, after, prompts, before_labels, after_labels)
    keep = first_of_each_prompt(prompts, max_prompts)
    font, border, gutter = caption_font(font_size), 2, 10
    w0, h0 = before[keep[0]].size
    size = (cell, max(1, round(cell * h0 / w0)))

    def fit(img: Image.Image) -> Image.Image:
        img = img.convert("RGB")
        resample = Image.NEAREST if img.width <= size[0] else Image.LANCZOS
        return ImageOps.expand(img.resize(size, resample), border=border, fill="white")

    line_h, text_w = _line_height(font), 2 * (size[0] + 2 * border) - 4
    captions = _pair_captions(keep, prompts, before_labels, after_labels, font, text_w, 3)
    text_h = line_h * max(len(p) + len(s) for p, s in captions) + 6
    pair_w, pair_h = 2 * (size[0] + 2 * border), size[1] + 2 * border
    cells = []
    for i, (prompt_lines, score_lines) in zip(keep, captions):
        pair = make_image_grid([fit(before[i]), fit(after[i])], rows=1, cols=2)  # diffusers tiles; captions: ours
        tile = Image.new("RGB", (pair_w + gutter, pair_h + text_h + gutter), "white")
        tile.paste(pair, (0, 0))
        draw = ImageDraw.Draw(tile)
        for j, line in enumerate(prompt_lines + score_lines):
            draw.text((4, pair_h + 3 + j * line_h), line, fill="black" if j < len(prompt_lines) else "dimgray",
                      font=font)
        cells.append(tile)
    cols = min(columns, len(cells))
    rows = -(-len(cells) // cols)
    cells += [Image.new("RGB", cells[0].size, "white")] * (rows * cols - len(cells))
    body = make_image_grid(cells, rows=rows, cols=cols)  # it has no captions or legend: the header is drawn here
    title_font = caption_font(font_size + 4)
    title_h = _line_height(title_font)
    title_lines = wrap_to_width(title, title_font, body.width - 8, 2) if title else []
    header_h = title_h * len(title_lines) + line_h + 8
    canvas = Image.new("RGB", (body.width, header_h + body.height), "white")
    canvas.paste(body, (0, header_h))
    draw = ImageDraw.Draw(canvas)
    for j, line in enumerate(title_lines):
        draw.text((4, 4 + j * title_h), line, fill="black", font=title_font)
    legend_y = 4 + len(title_lines) * title_h
    for c in range(cols):
        for k, (word, colour) in enumerate((("before", "dimgray"), ("after", "darkgreen"))):
            x = c * (pair_w + gutter) + k * (pair_w // 2) + (pair_w // 2 - font.getlength(word)) / 2
            draw.text((x, legend_y), word, fill=colour, font=font)
    return canvas


def make_video_comparison(before: list[list[Image.Image]], after: list[list[Image.Image]], prompts: list[str],
                          before_labels: list[str] | None = None, after_labels: list[str] | None = None,
                          title: str = "", columns: int = 2, frame_px: int = 96,
                          max_prompts: int = MAX_COMPARISON_PROMPTS,
                          font_size: int = COMPARISON_FONT_SIZE) -> Image.Image:
    """``make_comparison`` for videos: for each of the first ``max_prompts`` distinct prompts its before clip over
    its after clip, each a ``video_strip`` of ``frame_px`` px frames (time runs left to right) with "before" /
    "after" at its left, then the prompt and the labels under the pair; ``columns`` pairs to a row, a title on
    top. ValueError when the lists differ in length or are empty."""
    _check_lengths("make_video_comparison", "videos", before, after, prompts, before_labels, after_labels)
    keep = first_of_each_prompt(prompts, max_prompts)
    font, gutter = caption_font(font_size), 12
    line_h = _line_height(font)
    legend_w = int(max(font.getlength(w) for w in ("before", "after"))) + 8
    strips = [(video_strip(before[i], frame_px), video_strip(after[i], frame_px)) for i in keep]
    strip_w, strip_h = strips[0][0].size
    text_w = legend_w + strip_w
    captions = _pair_captions(keep, prompts, before_labels, after_labels, font, text_w, 2)
    text_h = line_h * max(len(p) + len(s) for p, s in captions) + 6
    tile_w, tile_h = text_w + gutter, 2 * strip_h + 4 + text_h + gutter
    cols = min(columns, len(keep))
    rows = -(-len(keep) // cols)
    title_font = caption_font(font_size + 4)
    title_h = _line_height(title_font)
    title_lines = wrap_to_width(title, title_font, cols * tile_w - 8, 2) if title else []
    header_h = title_h * len(title_lines) + 8
    canvas = Image.new("RGB", (cols * tile_w, header_h + rows * tile_h), "white")
    draw = ImageDraw.Draw(canvas)
    for j, line in enumerate(title_lines):
        draw.text((4, 4 + j * title_h), line, fill="black", font=title_font)
    for k, ((b, a), (prompt_lines, score_lines)) in enumerate(zip(strips, captions)):
        x, y = (k % cols) * tile_w, header_h + (k // cols) * tile_h
        for row, (strip, word, colour) in enumerate(((b, "before", "dimgray"), (a, "after", "darkgreen"))):
            top = y + row * (strip_h + 4)
            canvas.paste(strip, (x + legend_w, top))
            draw.text((x + 2, top + (strip_h - line_h) / 2), word, fill=colour, font=font)
        for j, line in enumerate(prompt_lines + score_lines):
            draw.text((x + 2, y + 2 * strip_h + 7 + j * line_h), line,
                      fill="black" if j < len(prompt_lines) else "dimgray", font=font)
    return canvas


def save_comparison(path: str | Path, *args, **kwargs) -> Image.Image:
    """``make_comparison(*args, **kwargs)`` (``make_video_comparison`` when the samples are videos) written to
    ``path`` (folders created); returns the image."""
    image = (make_video_comparison if args and args[0] and is_video(args[0][0]) else make_comparison)(*args, **kwargs)
    write_with(path, image.save, f"the comparison image {path}")
    return image
