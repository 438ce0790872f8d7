"""``pairwise``: Pref-GRPO's pairwise rewards (Wang et al. 2025, arXiv 2508.20751): a judge compares two samples of
the same prompt, and each sample's reward is its win rate against the other samples of its group
(``unialign.algos.advantages.win_rates``), which removes the "illusory advantage" of tiny score gaps blown up by
the group normalisation. Two ways in, one computation:

* a judge of two samples: ``get_reward("pairwise", judge="my_pkg.judge:prefer")`` with
  ``prefer(prompts, completions_a, completions_b) -> [P(a beats b)]`` (a float in [0, 1] or a 0 / 1 verdict
  per pair; e.g. a VLM asked which image follows the prompt better, as Pref-GRPO's UnifiedReward-Think);
* a score compared pairwise: ``get_reward("pairwise", score="pickscore")`` (any reward spec: its scores are
  compared within the group, ties count one half), or, equivalently for the advantages, the ``win_rate``
  advantage estimator (``--advantage win_rate``, preset ``pref_grpo``) over any reward.

Groups are the batch's samples with the same prompt (the online trainer samples a prompt's G together).
Every unordered pair is judged once, in a fixed order (the lower index as ``a``); P(b beats a) = 1 - P(a beats
b). A judge's position bias is therefore not averaged out; ``symmetric=True`` judges both orders and averages
(twice the calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unialign.algos.advantages import preferences_from_scores, win_rates


def group_indices(prompts: list[Any]) -> list[list[int]]:
    """Indices of the samples of each distinct prompt, in first-appearance order."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(repr(p), []).append(i)
    return list(groups.values())


def judged_preferences(judge: Callable, prompts: list[Any], completions: list[Any], idx: list[int],
                       symmetric: bool = False) -> torch.Tensor:
    """[G, G] float64 preferences of the samples ``idx`` (one prompt's): ``pref[i, j]`` = P(i beats j) from
    ``judge(prompts, a, b)`` over every pair i < j in one call (and j, i when ``symmetric``); NaN on the
    diagonal and where the judge returned a non-finite value."""
    G = len(idx)
    pref = torch.full((G, G), float("nan"), dtype=torch.float64)
    pairs = [(i, j) for i in range(G) for j in range(i + 1, G)]
    if not pairs:
        return pref

    def ask(order):
        out = judge([prompts[idx[i]] for i, _ in order], [completions[idx[i]] for i, _ in order],
                    [completions[idx[j]] for _, j in order])
        p = torch.as_tensor([float("nan") if v is None else float(v) for v in out], dtype=torch.float64)
        if p.numel() != len(order):
            raise ValueError(f"pairwise judge returned {p.numel()} values for {len(order)} pairs")
        if ((p < 0) | (p > 1)).any():
            raise ValueError("pairwise judge must return P(a beats b) in [0, 1]")
        return p

    p = ask(pairs)
    if symmetric:
        p = (p + 1 - ask([(j, i) for i, j in pairs])) / 2
    for (i, j), v in zip(pairs, p):
        pref[i, j], pref[j, i] = v, 1 - v
    return pref


class PairwiseReward:
    """Each sample's win rate in its group (module docstring), a float in [0, 1] (NaN for a sample with no
    finite comparison). Exactly one of ``judge`` (a callable or ``"module:function"`` spec of the two-sample
    judge) and ``score`` (a reward spec, built with ``score_kwargs``) is given."""

    name = "pairwise"

    def __init__(self, judge: Any = None, score: Any = None, score_kwargs: dict | None = None,
                 symmetric: bool = False) -> None:
        from unialign.rewards.base import get_reward
        from unialign.rewards.registry import resolve_reward

        if (judge is None) == (score is None):
            raise ValueError("pairwise: give exactly one of judge= (two samples -> P(a beats b)) and score=")
        if isinstance(judge, str):
            judge = resolve_reward(judge)[0]
        if judge is not None and not callable(judge):
            raise ValueError(f"pairwise: judge must be callable, got {type(judge).__name__}")
        self.judge, self.symmetric = judge, symmetric
        self.score = get_reward(score, **(score_kwargs or {})) if score is not None else None

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **columns: Any) -> list[float]:
        if prompts is None:
            raise TypeError("pairwise needs the prompts (its groups)")
        completions = list(completions)
        out = torch.full((len(prompts),), float("nan"), dtype=torch.float64)
        if self.score is not None:
            scores = self.score.score(prompts, completions, columns or None)
        for idx in group_indices(prompts):
            if self.score is not None:
                pref = preferences_from_scores(scores[idx].reshape(1, -1))[0]
            else:
                pref = judged_preferences(self.judge, prompts, completions, idx, self.symmetric)
            out[idx] = win_rates(pref.unsqueeze(0))[0]
        return out.tolist()
