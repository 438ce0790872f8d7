"""Held-out evaluation of a text policy: greedy decoding scored by a reward (e.g. exact math answers)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

SAMPLE_FIELDS = ("prompt", "completion", "step")  # a sample-table row's own keys; a scorer may not take one


def greedy_score(policy, rows: list[dict[str, Any]], reward_fn: Callable, batch_size: int = 64) -> float:
    """Mean reward of greedy completions on ``rows`` (dicts with ``prompt`` + reward columns); see
    ``greedy_scores``."""
    return greedy_scores(policy, rows, {"score": reward_fn}, batch_size)["score"]


def greedy_scores(policy, rows: list[dict[str, Any]], reward_fns: dict[str, Callable],
                  batch_size: int = 64) -> dict[str, float]:
    """One greedy decoding of ``rows``, each completion scored by every function of ``reward_fns`` (name ->
    TRL-signature reward); returns name -> the mean over the samples it scored. ``None`` and non-finite
    scores ("no score") are left out of the mean; a reward that scored none gives NaN (``null`` in
    summary.json), never a silent 0."""
    return greedy_samples(policy, rows, reward_fns, batch_size, keep=0)[0]


@torch.no_grad()
def greedy_samples(policy, rows: list[dict[str, Any]], reward_fns: dict[str, Callable], batch_size: int = 64,
                   keep: int = 0) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """``greedy_scores`` of ``rows`` plus the first ``keep`` rows as samples from the same decoding: one dict
    per row, ``{"prompt": <the row's prompt as given>, "completion": <text>, <name>: <score> ...}`` with one
    score per function of ``reward_fns`` (a float; ``None`` where the function gave no score: ``None`` or
    non-finite). Returns ``(means, samples)``; ``keep`` 0 gives no samples and costs nothing extra."""
    totals, counts = dict.fromkeys(reward_fns, 0.0), dict.fromkeys(reward_fns, 0)
    samples: list[dict[str, Any]] = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        prompts = [r["prompt"] for r in chunk]
        texts = policy.generate(prompts, greedy=True)["texts"]
        columns = {k: [r[k] for r in chunk] for k in chunk[0] if k != "prompt"}
        kept = [{"prompt": p, "completion": t} for p, t in zip(prompts, texts)][:max(0, keep - len(samples))]
        for name, fn in reward_fns.items():
            scores = [float(v) if v is not None and math.isfinite(float(v)) else None
                      for v in fn(prompts, texts, **columns)]
            valid = [v for v in scores if v is not None]
            totals[name] += sum(valid)
            counts[name] += len(valid)
            for sample, score in zip(kept, scores):
                sample[name] = score
        samples += kept
    means = {name: totals[name] / counts[name] if counts[name] else float("nan") for name in reward_fns}
    return means, samples


class GreedyHeldOut:
    """The evaluator a text script hands to ``OnlineTrainer``: ``greedy_scores`` of fixed held-out rows,
    so the trainer logs them (``eval/<name>``) before, every ``eval_steps`` and after training.

    Each call also sets ``samples``: the first ``num_samples`` rows' prompt, greedy completion and score per
    reward function (``greedy_samples``), which the trainer writes to ``<output_dir>/completions.jsonl`` and
    logs to its trackers as a table; ``num_samples`` 0 keeps none. A reward function named like a sample
    field (``prompt``, ``completion``, ``step``) is a ValueError: its column would hide that field."""

    def __init__(self, policy, rows: list[dict[str, Any]], reward_fns: dict[str, Callable], batch_size: int = 64,
                 num_samples: int = 8):
        clash = sorted(set(reward_fns) & set(SAMPLE_FIELDS))
        if clash:
            raise ValueError(f"GreedyHeldOut: reward functions named {clash} would hide the sample table's own "
                             f"{list(SAMPLE_FIELDS)} fields; name them otherwise")
        if num_samples < 0:
            raise ValueError(f"GreedyHeldOut: num_samples must be >= 0, got {num_samples}")
        self.policy, self.rows, self.reward_fns, self.batch_size = policy, rows, reward_fns, batch_size
        self.num_samples = num_samples
        self.samples: list[dict[str, Any]] = []

    def __call__(self) -> dict[str, float]:
        means, self.samples = greedy_samples(self.policy, self.rows, self.reward_fns, self.batch_size,
                                             self.num_samples)
        return means
