"""Images and videos in prompt rows: TRL's vision data formats read into one form, checked row by row before any
model loads.

Accepted rows (TRL's and verl's formats):

* ``{"prompt": [messages], "image": <image>}`` or ``{"prompt": ..., "images": [<image>, ...]}``; the messages may
  hold typed blocks (``{"type": "image"}`` / ``{"type": "text", "text": ...}``) or plain string contents;
* ``{"prompt": "What is in <image>?", "images": [...]}``: a string with literal ``<image>`` placeholders (verl);
* ``{"prompt": ..., "video": <video>}`` or ``"videos": [<video>, ...]``, with ``{"type": "video"}`` blocks or
  ``<video>`` placeholders, alone or beside images (the Qwen2-VL line's processors take both);
* rows without an image or video column: text-only rows, mixed freely with the others.

A video is a list of frames (each anything an image may be) or a video file (a path, decoded with PyAV -- the
``av`` package, FFmpeg's bindings, which transformers' own video loading uses too; the ``video`` extra), sampled
to at most ``max_frames`` evenly spaced frames and, for a file, at ``fps`` frames per second first
(``VideoSampling``).

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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from unialign.errors import UserError
from unialign.images import ImageRules, decodes, image_path, open_checked

PLACEHOLDER = "<image>"  # verl's literal placeholder in string prompts and string message contents
VIDEO_PLACEHOLDER = "<video>"
IMAGE_COLUMNS = ("image", "images")
VIDEO_COLUMNS = ("video", "videos")
MEDIA_COLUMNS = (*IMAGE_COLUMNS, *VIDEO_COLUMNS)
VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v", ".gif")


@dataclass(frozen=True)
class VideoSampling:
    """How a video becomes frames: at most ``max_frames`` evenly spaced ones (None: all); a file is first sampled
    at ``fps`` frames per second of its own time base (None: every decoded frame)."""

    fps: float | None = None
    max_frames: int | None = 16

    def __post_init__(self) -> None:
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"video_fps: must be > 0, got {self.fps}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames: must be >= 1, got {self.max_frames}")

    def thin(self, frames: list) -> list:
        """``frames`` cut to ``max_frames`` evenly spaced ones (the first and last kept)."""
        n, k = len(frames), self.max_frames
        if k is None or n <= k:
            return list(frames)
        if k == 1:
            return [frames[0]]
        return [frames[round(i * (n - 1) / (k - 1))] for i in range(k)]


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


MAX_DECODED_FRAMES = 4096  # frames kept while decoding one file (before thinning): a memory bound, not a choice


def _decode_video_file(path: Path, where: str, sampling: VideoSampling, rules: ImageRules) -> list:
    """The frames of a video file as RGB ``PIL.Image``s, at ``sampling.fps`` when set (PyAV). A frame over the image
    pixel limit (``rules``), or a file of more than ``MAX_DECODED_FRAMES`` kept frames, is refused naming ``where``;
    when the stream says how many frames it has (and no fps is asked), only the ``max_frames`` that ``thin`` would
    keep are converted."""
    try:
        import av
    except ImportError:
        from unialign.errors import MissingExtraError

        raise MissingExtraError(f"{where}: {path.name} is a video file, and decoding it needs PyAV (the 'av' "
                                "package): pip install 'unialign[video]'; or give the video as a list of frames") \
            from None
    frames, next_t = [], 0.0
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            wanted = None  # the indices thin() keeps, when the frame count is known up front
            if sampling.fps is None and sampling.max_frames is not None and (stream.frames or 0) > sampling.max_frames:
                wanted = set(sampling.thin(list(range(stream.frames))))
            for k, frame in enumerate(container.decode(stream)):
                if frame.width * frame.height > rules.limit():
                    raise UserError(f"{where}: {path} has {frame.width} x {frame.height} frames, over the image limit "
                                    f"of {rules.limit()} pixels (--max_image_pixels)")
                t = float(frame.pts * stream.time_base) if frame.pts is not None else k
                if wanted is not None and k not in wanted:
                    continue
                if sampling.fps is None or t + 1e-9 >= next_t:
                    frames.append(frame.to_image().convert("RGB"))
                    next_t = t + 1.0 / sampling.fps if sampling.fps else 0.0
                    if len(frames) > MAX_DECODED_FRAMES:
                        raise UserError(f"{where}: {path} has more than {MAX_DECODED_FRAMES} frames to keep; sample it "
                                        "with --video_fps")
    except (av.error.FFmpegError, IndexError) as err:
        raise UserError(f"{where}: {path} is not a readable video ({err})") from None
    if not frames:
        raise UserError(f"{where}: {path} holds no video frames")
    return frames


def load_video(value: Any, base_dir: str | Path | None = None, where: str = "video", rules: ImageRules | None = None,
               sampling: VideoSampling | None = None) -> list:
    """``value`` as a list of RGB frames (module docstring): a list of frames (each as ``load_image`` takes) or a
    video file's path (relative to ``base_dir``), thinned by ``sampling``. ``UserError`` naming ``where``."""
    sampling = sampling or VideoSampling()
    if isinstance(value, (list, tuple)):
        if not value:
            raise UserError(f"{where}: a video needs at least one frame")
        frames = [load_image(f, base_dir, f"{where}[{k}]", rules) for k, f in enumerate(value)]
    elif isinstance(value, (str, Path)) and Path(value).suffix.lower() in VIDEO_SUFFIXES:
        rules = rules or ImageRules(Path(base_dir) if base_dir is not None else None, confine=False)
        frames = _decode_video_file(image_path(value, where, rules), where, sampling, rules)  # a regular file, confined
    else:
        raise UserError(f"{where}: a video is a list of frames or a video file ({', '.join(VIDEO_SUFFIXES)}), got "
                        f"{type(value).__name__}")
    return sampling.thin(frames)


def row_videos(row: dict[str, Any], base_dir: str | Path | None = None, where: str = "row",
               rules: ImageRules | None = None, sampling: VideoSampling | None = None) -> list[list]:
    """The row's videos (``video``: one, ``videos``: a list; both is refused), loaded; [] for a row without."""
    if row.get("video") is not None and row.get("videos"):
        raise UserError(f"{where}: has both 'video' and 'videos'; give one")
    if row.get("videos") is not None:
        videos = row["videos"]
        if not isinstance(videos, (list, tuple)):
            raise UserError(f"{where}: field 'videos' must be a list of videos, got {type(videos).__name__}")
        return [load_video(v, base_dir, f"{where}: videos[{k}]", rules, sampling) for k, v in enumerate(videos)]
    if row.get("video") is not None:
        return [load_video(row["video"], base_dir, f"{where}: field 'video'", rules, sampling)]
    return []


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


PLACEHOLDERS = {"image": PLACEHOLDER, "video": VIDEO_PLACEHOLDER}


def _blocks(content: Any) -> list[dict[str, Any]]:
    """A message content as typed blocks; ``<image>`` / ``<video>`` placeholders in text become their blocks."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    for kind, mark in PLACEHOLDERS.items():
        out: list[dict[str, Any]] = []
        for part in parts:
            if part.get("type") == "text" and mark in part.get("text", ""):
                for k, piece in enumerate(part["text"].split(mark)):
                    if k:
                        out.append({"type": kind})
                    if piece:
                        out.append({"type": "text", "text": piece})
            else:
                out.append(dict(part))
        parts = out
    return parts


def count_blocks(prompt: Any, kind: str = "image") -> int:
    """``kind`` ("image" / "video") blocks and placeholders in a prompt (a string or messages)."""
    if isinstance(prompt, str):
        return prompt.count(PLACEHOLDERS[kind])
    return sum(1 for m in prompt for b in _blocks(m["content"]) if b.get("type") == kind)


def count_image_blocks(prompt: Any) -> int:
    """Image blocks / ``<image>`` placeholders in a prompt (a string or messages)."""
    return count_blocks(prompt, "image")


def multimodal_prompt(prompt: Any, images: list, where: str = "row", videos: list | None = None) -> Any:
    """The prompt as messages whose image blocks hold ``images`` and whose video blocks hold ``videos`` (lists of
    frames) in order (module docstring), or the prompt unchanged when the row has neither and no placeholders.
    ``UserError`` when a kind's counts differ."""
    videos = list(videos or [])
    media = {"image": list(images), "video": videos}
    wanted = {kind: count_blocks(prompt, kind) for kind in media}
    if not any(media.values()) and not any(wanted.values()):
        return prompt
    for kind, items in media.items():
        if wanted[kind] and wanted[kind] != len(items):
            raise UserError(f"{where}: the prompt has {wanted[kind]} {kind} placeholder(s) but the row has "
                            f"{len(items)} {kind}(s); give one {kind} per {{'type': '{kind}'}} block / "
                            f"'{PLACEHOLDERS[kind]}'")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    messages = [{**m, "content": _blocks(m["content"])} for m in messages]
    missing = [{"type": kind} for kind in ("video", "image") if not wanted[kind] for _ in media[kind]]
    if missing:  # TRL: the media go first in the first user message (videos before images, as Qwen's examples)
        first = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise UserError(f"{where}: the row has images or videos but its prompt has no user message to put them in")
        messages[first]["content"] = missing + messages[first]["content"]
    its = {kind: iter(items) for kind, items in media.items()}
    for m in messages:
        m["content"] = [{"type": b["type"], b["type"]: next(its[b["type"]])} if b.get("type") in its else b
                        for b in m["content"]]
    return messages


def _prompt_media(prompt: Any, kind: str) -> list:
    if isinstance(prompt, str):
        return []
    return [b[kind] for m in prompt if isinstance(m.get("content"), list)
            for b in m["content"] if isinstance(b, dict) and b.get("type") == kind and kind in b]


def prompt_images(prompt: Any) -> list:
    """The images a ``multimodal_prompt`` carries, in order ([] for a string or a text-only conversation)."""
    return _prompt_media(prompt, "image")


def prompt_videos(prompt: Any) -> list[list]:
    """The videos (lists of frames) a ``multimodal_prompt`` carries, in order."""
    return _prompt_media(prompt, "video")


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
    """The prompt with its image and video blocks emptied (``{"type": "image"}``, ``{"type": "video"}``): what a
    chat template renders."""
    if isinstance(prompt, str):
        return prompt
    return [{**m, "content": [{"type": b["type"]} if isinstance(b, dict) and b.get("type") in PLACEHOLDERS else b
                              for b in m["content"]]} if isinstance(m.get("content"), list) else m for m in prompt]


def vision_rows(rows: list[dict[str, Any]], source: str = "dataset", base_dir: str | Path | None = None,
                rules: ImageRules | None = None, bad_rows: list[str] | None = None,
                video: VideoSampling | None = None) -> list[dict[str, Any]]:
    """Rows with ``image`` / ``images`` / ``video`` / ``videos`` columns -> rows whose ``prompt`` carries them
    (``multimodal_prompt``); those columns are dropped (the prompt holds them), the other columns kept (they reach
    the rewards). Text-only rows pass through. Every image and frame is checked and decoded now
    (``unialign.images``, under ``rules``; videos sampled by ``video``). ``UserError`` naming the first bad row,
    or -- when a ``bad_rows`` list is given -- each bad row's line appended to it and the row skipped."""
    out = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        try:
            images = row_images(row, base_dir, where, rules)
            videos = row_videos(row, base_dir, where, rules, video)
            rest = {k: v for k, v in row.items() if k not in MEDIA_COLUMNS}
            rest["prompt"] = multimodal_prompt(row["prompt"], images, where, videos)
        except UserError as err:
            if bad_rows is None:
                raise
            bad_rows.append(str(err))
            continue
        out.append(rest)
    return out
