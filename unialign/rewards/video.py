"""Video rewards from image rewards: any image reward applied to every frame and reduced per video, and a
temporal-consistency term. A video completion is a list of frames (PIL images, uint8 or float [0, 1] arrays) or a
tensor [F, 3, H, W]; a batch of videos is a list of those or a tensor [B, F, 3, H, W].

    PerFrameReward(reward="aesthetic", reduction="mean", **reward_kwargs)
        the image reward (a registered name, a spec ``get_reward`` takes, or a TRL-signature callable) on every
        frame, with each video's prompt and dataset columns repeated per frame, reduced by "mean" or "min" (the
        worst frame: a clip is as good as its weakest frame). A frame scored NaN makes its video NaN.
    TemporalConsistencyReward(kind="pixel")
        how much adjacent frames agree, in [0, 1]: "pixel", 1 - mean |f_t - f_{t+1}| over RGB in [0, 1] (DanceGRPO
        and video-RL reports penalise flicker; this is the cheapest reading of it); "clip", the mean cosine of
        adjacent frames' CLIP image embeddings (an open_clip model, or ``clip=`` the embedded one). A one-frame
        video scores 1. It rewards a still video as much as a smooth one: combine it with a per-frame fidelity
        reward (``--reward_funcs per_frame,temporal_consistency --reward_weights 1,0.2``), never alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

REDUCTIONS = ("mean", "min")


def video_frames(video: Any) -> list:
    """One video as a list of frames (each as the image rewards take it): a list / tuple of frames, or a tensor /
    array [F, 3, H, W] or [F, H, W, 3]."""
    if isinstance(video, (list, tuple)):
        if not video:
            raise ValueError("a video needs at least one frame")
        return list(video)
    if isinstance(video, (torch.Tensor, np.ndarray)) and video.ndim == 4:
        return [video[i] for i in range(video.shape[0])]
    raise TypeError(f"a video is a list of frames or a [F, C, H, W] tensor, got {type(video).__name__}")


def batch_videos(completions: Any) -> list[list]:
    """The batch's videos as lists of frames (a list of videos, or a tensor [B, F, ...])."""
    if isinstance(completions, (torch.Tensor, np.ndarray)):
        if completions.ndim != 5:
            raise ValueError(f"a batch of videos is [B, F, C, H, W], got shape {tuple(completions.shape)}")
        return [video_frames(completions[i]) for i in range(completions.shape[0])]
    return [video_frames(v) for v in completions]


class PerFrameReward:
    """An image reward on every frame of each video, reduced per video (module docstring)."""

    name = "per_frame"

    def __init__(self, reward: str | Callable = "aesthetic", reduction: str = "mean", **reward_kwargs: Any) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if isinstance(reward, str):
            from unialign.rewards.base import get_reward

            reward = get_reward(reward, **reward_kwargs)
        elif reward_kwargs:
            raise ValueError("reward keyword arguments are for a reward given by name")
        self.reward, self.reduction = reward, reduction

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **columns: Any) -> list[float]:
        videos = batch_videos(completions)
        counts = [len(v) for v in videos]
        frames = [f for v in videos for f in v]
        repeat = (lambda xs: [x for x, n in zip(xs, counts) for _ in range(n)])  # noqa: E731 - per frame
        kwargs = {k: repeat(v) if isinstance(v, (list, tuple)) and len(v) == len(videos) else v
                  for k, v in columns.items()}
        scores = self.reward(prompts=repeat(prompts) if prompts is not None else None, completions=frames, **kwargs)
        flat = torch.tensor([float("nan") if s is None else float(s) for s in scores], dtype=torch.float64)
        out, start = [], 0
        for n in counts:
            part = flat[start:start + n]
            start += n
            out.append(float(part.mean() if self.reduction == "mean" else part.min()))
        return out


class TemporalConsistencyReward:
    """Agreement of adjacent frames in [0, 1] (module docstring)."""

    name = "temporal_consistency"

    def __init__(self, kind: str = "pixel", model_name: str = "ViT-B-32", pretrained: str = "openai",
                 device: str | torch.device | None = None, clip: Any = None) -> None:
        if kind not in ("pixel", "clip"):
            raise ValueError(f"kind must be 'pixel' or 'clip', got {kind!r}")
        self.kind, self.encoder = kind, None
        if kind == "clip":
            from unialign.rewards.image import ClipScoreReward

            self.encoder = ClipScoreReward(model_name, pretrained, device=device, clip=clip)

    @torch.no_grad()
    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        from unialign.rewards.image import to_pil_images

        out = []
        for frames in batch_videos(completions):
            if len(frames) < 2:
                out.append(1.0)
                continue
            pils = to_pil_images(frames)
            if self.kind == "pixel":
                x = torch.from_numpy(np.stack([np.asarray(p.convert("RGB"), dtype=np.float32) / 255 for p in pils]))
                out.append(float(1.0 - (x[1:] - x[:-1]).abs().mean()))
            else:
                e = self.encoder.image_embeddings(pils).float()
                out.append(float((e[1:] * e[:-1]).sum(-1).mean()))
        return out
