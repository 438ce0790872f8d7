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
