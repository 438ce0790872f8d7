"""Held-out evaluation of an image policy: the same prompts sampled with the same seed before and after
training, scored by a reward (TRL signature) and/or a gold score (images -> tensor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


@torch.no_grad()
def sample_scores(policy, prompts: list[str], seed: int, reward: Callable | None = None,
                  gold: Callable | None = None) -> dict[str, Any]:
    """Sample ``prompts`` once with ``torch.Generator().manual_seed(seed)``; returns ``images`` and, for
    each scorer given, per-image ``scores`` / ``gold_scores`` [N] with their ``mean`` / ``std`` /
    ``gold_mean`` / ``gold_std``."""
    images = policy.sample(prompts, generator=torch.Generator().manual_seed(seed)).completions
    out: dict[str, Any] = {"images": images}
    if reward is not None:
        scores = torch.tensor(reward(prompts, images), dtype=torch.float32)
        out.update(scores=scores, mean=float(scores.mean()), std=float(scores.std()))
    if gold is not None:
        g = gold(images)
        out.update(gold_scores=g, gold_mean=float(g.mean()), gold_std=float(g.std()))
    return out
