"""Held-out evaluation of an image policy: the same prompts sampled with the same seed before, during and
after training, scored by a reward (TRL signature), prompt fidelity (a verifier) and/or a gold score."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


@torch.no_grad()
def sample_scores(policy, prompts: list[str], seed: int, reward: Callable | None = None,
                  gold: Callable | None = None, verifier: Callable | None = None,
                  batch_size: int = 64, columns: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """Sample ``prompts`` in chunks of ``batch_size`` from one ``torch.Generator().manual_seed(seed)`` (the
    same images on every call with the same prompts, seed and ``batch_size``); returns ``images`` and,
    for each scorer given:

    * ``reward`` (a ``CombinedReward`` or a TRL-signature function): per-image ``scores`` [N], ``mean``,
      ``std``, for a combination of several each part's mean as ``reward/<name>``, and the batch metrics the
      functions report (e.g. GenEval's strict rate) as ``rewards/<name>/<metric>``;
    * ``gold`` (images -> tensor [N]): ``gold_scores``, ``gold_mean``, ``gold_std``;
    * ``verifier`` ((prompts, images) -> dict of [N] tensors: ``all``, the 0 / 1 verdict, and any per-part
      rates): ``fidelity`` = the all-right rate, ``fidelity/<name>`` the mean of every other entry, and the
      per-image ``fidelity_flags`` [N] (and ``reader_flags`` [N] when it returns a second reading, ``reader``).

    ``columns``: dataset columns of the prompts (name -> [N] values, e.g. GenEval's metadata), given to the
    reward and the verifier as TRL gives them to reward functions.
    """
    generator = torch.Generator().manual_seed(seed)
    images = []
    for i in range(0, len(prompts), batch_size):
        images += policy.sample(prompts[i:i + batch_size], generator=generator, record_logp=False).completions
    out: dict[str, Any] = {"images": images}
    if reward is not None:
        from unialign.rewards import CombinedReward

        combined = reward if isinstance(reward, CombinedReward) else CombinedReward([reward])
        scored = combined(prompts, images, columns or None)
        scores = scored.rewards_B
        out.update(scores=scores, mean=float(scores.nanmean()), std=float(scores[torch.isfinite(scores)].std()))
        if len(scored.per_function) > 1:
            out.update({f"reward/{k}": float(v.nanmean()) for k, v in scored.per_function.items()})
        out.update({f"rewards/{k}": v for k, v in scored.function_metrics.items()})
    if gold is not None:
        g = gold(images)
        out.update(gold_scores=g, gold_mean=float(g.mean()), gold_std=float(g.std()))
    if verifier is not None:
        checks = verifier(prompts, images, **columns) if columns else verifier(prompts, images)
        out.update(fidelity=float(checks["all"].mean()), fidelity_flags=checks["all"],
                   **{f"fidelity/{k}": float(v.mean()) for k, v in checks.items() if k != "all"})
        if "reader" in checks:  # a second, independent reading (the embedded world's shape reader)
            out["reader_flags"] = checks["reader"]
    return out


class HeldOutImages:
    """The evaluator an image script hands to ``OnlineTrainer``: ``sample_scores`` on fixed prompts and
    seed; calling it returns the numbers (``reward``, ``reward_std``, ``fidelity`` and its parts,
    ``gold``) plus ``grid`` (a captioned image grid of the first ``grid_size`` samples) for the
    trackers. ``last`` keeps the full result (images, per-image scores) of the latest call."""

    def __init__(self, policy, prompts: list[str], seed: int, reward: Callable | None = None,
                 gold: Callable | None = None, verifier: Callable | None = None, grid_size: int = 32,
                 batch_size: int = 64, columns: dict[str, list[Any]] | None = None) -> None:
        self.policy, self.prompts, self.seed = policy, list(prompts), seed
        self.columns = columns
        self.reward, self.gold, self.verifier = reward, gold, verifier
        self.grid_size, self.batch_size = grid_size, batch_size
        self.last: dict[str, Any] = {}

    def __call__(self) -> dict[str, Any]:
        from unialign.image.grid import make_grid

        res = sample_scores(self.policy, self.prompts, self.seed, self.reward, self.gold, self.verifier,
                            self.batch_size, self.columns)
        self.last = res
        metrics: dict[str, Any] = {}
        if self.reward is not None:
            metrics.update(reward=res["mean"], reward_std=res["std"],
                           **{k: v for k, v in res.items() if k.startswith(("reward/", "rewards/"))})
        if self.verifier is not None:
            metrics.update({k: v for k, v in res.items() if k == "fidelity" or k.startswith("fidelity/")})
        if self.gold is not None:
            metrics["gold"] = res["gold_mean"]
        n = min(self.grid_size, len(self.prompts))
        metrics["grid"] = make_grid(res["images"][:n], self.captions()[:n])
        return metrics

    def captions(self) -> list[str]:
        """One caption per image of the latest call: the prompt, then its reward score, then "ok" / "x"
        for the verifier's all-three-right (and "r:ok" / "r:x" for a second reader's)."""
        return [" | ".join([prompt, *parts]) for prompt, parts in zip(self.prompts, self._label_parts(self.last))]

    def labels(self, res: dict[str, Any] | None = None) -> list[str]:
        """One label per image of ``res`` (a ``sample_scores`` result; default: the latest call's) without the
        prompt: "0.412 ok" (reward score or "gold <score>", then the verifier's "ok" / "x"); "" when nothing
        scored it. The captions of ``comparison.png``."""
        return [" ".join(parts) for parts in self._label_parts(self.last if res is None else res)]

    def _label_parts(self, res: dict[str, Any]) -> list[list[str]]:
        out = []
        for i in range(len(self.prompts)):
            parts = []
            if "scores" in res:
                parts.append(f"{float(res['scores'][i]):.3f}")
            elif "gold_scores" in res:
                parts.append(f"gold {float(res['gold_scores'][i]):.3f}")
            if "fidelity_flags" in res:
                parts.append("ok" if res["fidelity_flags"][i] > 0 else "x")
            if "reader_flags" in res:  # the independent reader's verdict beside the verifier's
                parts.append("r:ok" if res["reader_flags"][i] > 0 else "r:x")
            out.append(parts)
        return out

    def save_comparison(self, path: str | Path, before: dict[str, Any], after: dict[str, Any],
                        title: str = "") -> Path:
        """``comparison.png`` of two results of this evaluator (``last`` before and after training: the same
        prompts and seed): ``unialign.image.grid.save_comparison`` of the first 32 distinct prompts with their
        ``labels``. Returns ``path``."""
        from unialign.image import grid

        grid.save_comparison(path, before["images"], after["images"], self.prompts, self.labels(before),
                             self.labels(after), title=title)
        return Path(path)
