"""What the vision-language scripts share: image-size and tower flags, rows with images read and checked before any
model loads, and the policy of a checkpoint chosen by its config (a VLM or a text LM) for scripts that take both."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unialign.config import UserError, arg
from unialign.images import ImageDataArgs, ImageRules, note_skipped

FREEZE_VISION_HELP = ("train the language model only, the vision tower frozen (as EasyR1 and TRL's VLM examples; on "
                      "the embedded task, GRPO at lr 1e-3 with the tower trained too lost 10 points of held-out "
                      "accuracy); false: train the tower as well")


@dataclass
class VideoDataArgs(ImageDataArgs):
    """How the rows' videos (``video`` / ``videos`` columns: frame lists or video files) become frames."""

    video_fps: float | None = arg(None, "a video file is sampled at this many frames per second (unset: every "
                                  "decoded frame); frame lists are taken as they are", group="data", gt=0.0)
    max_frames: int | None = arg(16, "at most this many evenly spaced frames per video (each frame costs the "
                                 "processor's image tokens; 0: no limit)", group="data", min=0)

    def video_sampling(self):
        from unialign.vision.media import VideoSampling

        return VideoSampling(self.video_fps, self.max_frames or None)


@dataclass
class VisionTowerArgs(VideoDataArgs):
    """The vision-tower flag of scripts that train text LMs and vision-language models alike (DPO)."""

    freeze_vision: bool = arg(True, "a vision-language checkpoint: " + FREEZE_VISION_HELP + " (a text LM has no "
                              "tower: no effect)", group="model")


@dataclass
class VisionArgs(VideoDataArgs):
    """Fields of the scripts that train vision-language policies."""

    max_pixels: int | None = arg(None, "processor: largest image area in pixels (Qwen-VL's max_pixels; fewer pixels, "
                                 "fewer image tokens); unset: the processor's own", group="model", min=1)
    min_pixels: int | None = arg(None, "processor: smallest image area in pixels (Qwen-VL's min_pixels)",
                                 group="model", min=1)
    freeze_vision: bool = arg(True, FREEZE_VISION_HELP, group="model")
    prompt_column: str = arg("prompt", "the column holding the prompt (e.g. 'problem' for geometry3k); it is read "
                             "as 'prompt'", group="data")
    prompt_template: str | None = arg(None, "a string prompt becomes this with {content} replaced by it (e.g. "
                                      "EasyR1's reasoning instruction); unset: the prompt as it is", group="data")


def processor_kwargs(cfg: Any) -> dict[str, int]:
    """The processor's image-size knobs set by ``cfg`` (``--max_pixels`` / ``--min_pixels``)."""
    return {k: getattr(cfg, k) for k in ("max_pixels", "min_pixels") if getattr(cfg, k, None) is not None}


def data_folder(name: str) -> Path | None:
    """Where a data set's relative image paths are read from: the file's folder, the folder itself, else None."""
    path = Path(name)
    return path.parent if path.is_file() else path if path.is_dir() else None


def with_images(rows: list[dict[str, Any]], cfg: Any, source: str, info: dict | None = None) -> list[dict[str, Any]]:
    """``rows`` (already in TRL's prompt format, ``--prompt_column`` read as the prompt by ``load_prompt_data``)
    with their images and videos in their prompts (``vision_rows``; videos sampled by ``--video_fps`` /
    ``--max_frames``), ``cfg.prompt_template`` applied; every image checked and decoded under ``cfg``'s ``ImageDataArgs``: errors
    name the row, or with ``--skip_bad_rows`` such rows are skipped, counted in the log and in ``info``
    (``bad_rows_skipped``, which summary.json carries)."""
    from unialign.vision.media import vision_rows

    template = getattr(cfg, "prompt_template", None)
    if template:
        if "{content}" not in template:
            raise UserError(f"--prompt_template must contain {{content}} (where the prompt goes), got {template!r}")
        rows = [{**r, "prompt": template.replace("{content}", r["prompt"])} if isinstance(r["prompt"], str) else r
                for r in rows]
    folder = data_folder(cfg.dataset_name)
    rules = ImageRules.of(cfg, folder)
    bad: list[str] | None = [] if getattr(cfg, "skip_bad_rows", False) else None
    sampling = cfg.video_sampling() if isinstance(cfg, VideoDataArgs) else None
    out = vision_rows(rows, source, folder, rules, bad, sampling)
    note_skipped(bad or [], len(rows), source, info)
    return out


def is_vision_checkpoint(name_or_path: str) -> bool:
    """Whether a local checkpoint's config is a vision-language model's (it has a vision tower)."""
    import json

    cfg = Path(name_or_path) / "config.json"
    if not cfg.is_file():
        return False
    data = json.loads(cfg.read_text())
    return "vision_config" in data


def has_images(rows: list[dict[str, Any]]) -> bool:
    """Whether any row has an image or a video column."""
    return any(r.get("image") is not None or r.get("images") or r.get("video") is not None or r.get("videos")
               for r in rows)


def load_policy(name_or_path: str, freeze_vision: bool = False, **kwargs: Any):
    """A ``VisionLanguagePolicy`` for a vision-language checkpoint (a local folder whose config has a vision
    tower; ``freeze_vision`` freezes its tower), else a ``CausalLMPolicy`` (``freeze_vision`` has nothing to
    freeze): the scripts that take both (DPO) load through here. ``kwargs`` as their ``from_pretrained``."""
    if is_vision_checkpoint(name_or_path):
        from unialign.vision.policy import VisionLanguagePolicy

        return VisionLanguagePolicy.from_pretrained(name_or_path, freeze_vision=freeze_vision, **kwargs)
    from unialign.text.policy import CausalLMPolicy

    return CausalLMPolicy.from_pretrained(name_or_path, **kwargs)


def greedy_task_score(policy, cfg: Any, task: str) -> float:
    """The greedy score of reward ``task`` on a built-in data set's own task (``--dataset_name``'s test split, its
    first ``--num_eval`` prompts, images read and checked where the rows have them)."""
    from unialign.rewards import get_reward
    from unialign.text import evaluate, load_rows
    from unialign.text.data import prompt_rows

    rows = prompt_rows(load_rows(cfg.dataset_name, "test")[:cfg.num_eval], "eval",
                       getattr(cfg, "prompt_column", "prompt"))
    rows = with_images(rows, cfg, "eval") if has_images(rows) else rows
    return evaluate.greedy_score(policy, rows, get_reward(task), cfg.eval_batch_size)
