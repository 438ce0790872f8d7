"""Held-out evaluation of a text policy: greedy decoding scored by a reward (e.g. exact math answers)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def greedy_score(policy, rows: list[dict[str, Any]], reward_fn: Callable, batch_size: int = 64) -> float:
    """Mean reward of greedy completions on ``rows`` (dicts with ``prompt`` + reward columns); see
    ``greedy_scores``."""
    return greedy_scores(policy, rows, {"score": reward_fn}, batch_size)["score"]


@torch.no_grad()
def greedy_scores(policy, rows: list[dict[str, Any]], reward_fns: dict[str, Callable],
                  batch_size: int = 64) -> dict[str, float]:
    """One greedy decoding of ``rows``, each completion scored by every function of ``reward_fns`` (name ->
    TRL-signature reward); returns name -> the mean over the samples it scored. ``None`` and non-finite
    scores ("no score") are left out of the mean; a reward that scored none gives NaN (``null`` in
    summary.json), never a silent 0."""
    totals, counts = dict.fromkeys(reward_fns, 0.0), dict.fromkeys(reward_fns, 0)
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        prompts = [r["prompt"] for r in chunk]
        texts = policy.generate(prompts, greedy=True)["texts"]
        columns = {k: [r[k] for r in chunk] for k in chunk[0] if k != "prompt"}
        for name, fn in reward_fns.items():
            valid = [float(v) for v in fn(prompts, texts, **columns) if v is not None and math.isfinite(float(v))]
            totals[name] += sum(valid)
            counts[name] += len(valid)
    return {name: totals[name] / counts[name] if counts[name] else float("nan") for name in reward_fns}


class GreedyHeldOut:
    """The evaluator a text script hands to ``OnlineTrainer``: ``greedy_scores`` of fixed held-out rows,
    so the trainer logs them (``eval/<name>``) before, every ``eval_steps`` and after training."""

    def __init__(self, policy, rows: list[dict[str, Any]], reward_fns: dict[str, Callable], batch_size: int = 64):
        self.policy, self.rows, self.reward_fns, self.batch_size = policy, rows, reward_fns, batch_size

    def __call__(self) -> dict[str, float]:
        return greedy_scores(self.policy, self.rows, self.reward_fns, self.batch_size)
