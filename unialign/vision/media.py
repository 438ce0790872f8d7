"""Images in prompt rows: TRL's vision data formats read into one form, checked row by row before any model loads.

Accepted rows (TRL's and verl's formats):

* ``{"prompt": [messages], "image": <image>}`` or ``{"prompt": ..., "images": [<image>, ...]}``; the messages may
  hold typed blocks (``{"type": "image"}`` / ``{"type": "text", "text": ...}``) or plain string contents;
* ``{"prompt": "What is in <image>?", "images": [...]}``: a string with literal ``<image>`` placeholders (verl);
* rows without an image column: text-only rows, mixed freely with the others.

An image may be a ``PIL.Image``, encoded bytes (PNG / JPEG ...), datasets' ``{"bytes": ..., "path": ...}`` or a
path, relative to the data file's folder (``base_dir``) when not absolute.

``multimodal_prompt`` turns a row into a conversation whose image blocks carry their image
(``{"type": "image", "image": PIL.Image}``), so the prompt alone is what the policy needs: trainers pass prompts
around without knowing they hold images. Placement follows TRL's ``prepare_multimodal_messages``: a row whose
messages have no image block gets its images, in order, at the start of the first user message. A row whose
image blocks (or ``<image>`` placeholders) are not as many as its images is refused naming the row -- the
data-side cause of transformers' "Image features and image tokens do not match".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image

from unialign.errors import UserError
from unialign.images import ImageRules, decodes, open_checked

PLACEHOLDER = "<image>"  # verl's literal placeholder in string prompts and string message contents
IMAGE_COLUMNS = ("image", "images")


def load_image(value: Any, base_dir: str | Path | None = None, where: str = "image", rules: ImageRules | None = None):
    """``value`` as an RGB ``PIL.Image``: a PIL image, encoded bytes, ``{"bytes", "path"}`` or a path
    (relative to ``base_dir``), checked and decoded by ``unialign.images`` (a regular file, inside the data folder
    when ``rules`` confine it, at most the pixel limit, whole). ``UserError`` naming ``where`` otherwise."""
    if isinstance(value, Image.Image):
        open_checked(value, where, rules)
        return value.convert("RGB") if value.mode != "RGB" else value
    rules = rules or ImageRules(Path(base_dir) if base_dir is not None else None, confine=False)
    with open_checked(value, where, rules) as image:
        return decodes(image, where, rules).convert("RGB")  # a copy: the file is closed on return


def row_images(row: dict[str, Any], base_dir: str | Path | None = None, where: str = "row",
               rules: ImageRules | None = None) -> list:
    """The row's images (``image``: one, ``images``: a list; both is refused), loaded; [] for a text-only row."""
    if "image" in row and "images" in row and row["image"] is not None and row["images"]:
        raise UserError(f"{where}: has both 'image' and 'images'; give one")
    if row.get("images") is not None:
        images = row["images"]
        if not isinstance(images, (list, tuple)):
            raise UserError(f"{where}: field 'images' must be a list of images, got {type(images).__name__}")
        return [load_image(im, base_dir, f"{where}: images[{k}]", rules) for k, im in enumerate(images)]
    if row.get("image") is not None:
        return [load_image(row["image"], base_dir, f"{where}: field 'image'", rules)]
    return []


def _blocks(content: Any) -> list[dict[str, Any]]:
    """A message content as typed blocks; ``<image>`` placeholders in text become image blocks."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    out: list[dict[str, Any]] = []
    for part in parts:
        if part.get("type") == "text" and PLACEHOLDER in part.get("text", ""):
            pieces = part["text"].split(PLACEHOLDER)
            for k, piece in enumerate(pieces):
                if k:
                    out.append({"type": "image"})
                if piece:
                    out.append({"type": "text", "text": piece})
        else:
            out.append(dict(part))
    return out


def count_image_blocks(prompt: Any) -> int:
    """Image blocks / ``<image>`` placeholders in a prompt (a string or messages)."""
    if isinstance(prompt, str):
        return prompt.count(PLACEHOLDER)
    return sum(1 for m in prompt for b in _blocks(m["content"]) if b.get("type") == "image")


def multimodal_prompt(prompt: Any, images: list, where: str = "row") -> Any:
    """The prompt as messages whose image blocks hold ``images`` in order (module docstring), or the prompt
    unchanged when the row has no images and no placeholders. ``UserError`` when the counts differ."""
    wanted = count_image_blocks(prompt)
    if not images and not wanted:
        return prompt
    if wanted and wanted != len(images):
        raise UserError(f"{where}: the prompt has {wanted} image placeholder(s) but the row has {len(images)} "
                        "image(s); give one image per {'type': 'image'} block / '<image>'")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    messages = [{**m, "content": _blocks(m["content"])} for m in messages]
    if not wanted:  # TRL: the images go first in the first user message
        first = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise UserError(f"{where}: the row has images but its prompt has no user message to put them in")
        messages[first]["content"] = [{"type": "image"} for _ in images] + messages[first]["content"]
    it = iter(images)
    for m in messages:
        m["content"] = [{"type": "image", "image": next(it)} if b.get("type") == "image" else b for b in m["content"]]
    return messages


def prompt_images(prompt: Any) -> list:
    """The images a ``multimodal_prompt`` carries, in order ([] for a string or a text-only conversation)."""
    if isinstance(prompt, str):
        return []
    return [b["image"] for m in prompt if isinstance(m.get("content"), list)
            for b in m["content"] if isinstance(b, dict) and b.get("type") == "image" and "image" in b]


def prompt_text(prompt: Any) -> str:
    """The text of a prompt (a string, or the string contents and text blocks of its messages), joined."""
    if isinstance(prompt, str):
        return prompt
    parts = []
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str)]
    return "".join(parts)


def strip_images(prompt: Any) -> Any:
    """The prompt with its image blocks emptied (``{"type": "image"}``): what a chat template renders."""
    if isinstance(prompt, str):
        return prompt
    return [{**m, "content": [{"type": "image"} if isinstance(b, dict) and b.get("type") == "image" else b
                              for b in m["content"]]} if isinstance(m.get("content"), list) else m for m in prompt]


def vision_rows(rows: list[dict[str, Any]], source: str = "dataset", base_dir: str | Path | None = None,
                rules: ImageRules | None = None, bad_rows: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows with ``image`` / ``images`` columns -> rows whose ``prompt`` carries the images
    (``multimodal_prompt``); the image columns are dropped (the prompt holds them), the other columns kept
    (they reach the rewards). Text-only rows pass through. Every image is checked and decoded now
    (``unialign.images``, under ``rules``). ``UserError`` naming the first bad row, or -- when a ``bad_rows`` list
    is given -- each bad row's line appended to it and the row skipped."""
    out = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        try:
            images = row_images(row, base_dir, where, rules)
            rest = {k: v for k, v in row.items() if k not in IMAGE_COLUMNS}
            rest["prompt"] = multimodal_prompt(row["prompt"], images, where)
        except UserError as err:
            if bad_rows is None:
                raise
            bad_rows.append(str(err))
            continue
        out.append(rest)
    return out
