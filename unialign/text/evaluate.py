"""Held-out evaluation of a text policy: greedy decoding scored by a reward (e.g. exact math answers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


@torch.no_grad()
def greedy_score(policy, rows: list[dict[str, Any]], reward_fn: Callable, batch_size: int = 64) -> float:
    """Mean reward of greedy completions on ``rows`` (dicts with ``prompt`` + reward columns)."""
    total, n = 0.0, 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        out = policy.generate([r["prompt"] for r in chunk], greedy=True)
        columns = {k: [r[k] for r in chunk] for k in chunk[0] if k != "prompt"}
        scores = reward_fn([r["prompt"] for r in chunk], out["texts"], **columns)
        total += sum(0.0 if s is None else float(s) for s in scores)
        n += len(chunk)
    return total / max(1, n)


@torch.no_grad()
def greedy_scores(policy, rows: list[dict[str, Any]], reward_fns: dict[str, Callable],
                  batch_size: int = 64) -> dict[str, float]:
    """``greedy_score`` for several rewards at once: one greedy decoding of ``rows``, each completion
    scored by every function of ``reward_fns`` (name -> TRL-signature reward); returns name -> mean."""
    totals, n = dict.fromkeys(reward_fns, 0.0), 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        prompts = [r["prompt"] for r in chunk]
        texts = policy.generate(prompts, greedy=True)["texts"]
        columns = {k: [r[k] for r in chunk] for k in chunk[0] if k != "prompt"}
        for name, fn in reward_fns.items():
            totals[name] += sum(0.0 if s is None else float(s) for s in fn(prompts, texts, **columns))
        n += len(chunk)
    return {name: total / max(1, n) for name, total in totals.items()}


class GreedyHeldOut:
    """The evaluator a text script hands to ``OnlineTrainer``: ``greedy_scores`` of fixed held-out rows,
    so the trainer logs them (``eval/<name>``) before, every ``eval_steps`` and after training."""

    def __init__(self, policy, rows: list[dict[str, Any]], reward_fns: dict[str, Callable], batch_size: int = 64):
        self.policy, self.rows, self.reward_fns, self.batch_size = policy, rows, reward_fns, batch_size

    def __call__(self) -> dict[str, float]:
        return greedy_scores(self.policy, self.rows, self.reward_fns, self.batch_size)
