"""Per-step diagnostics of the importance ratio, for trajectories whose steps are the same for every sample (a
sampler's denoising steps): GRPO-Guard's observation (arXiv 2510.22319) that Flow-GRPO's per-step ratios sit below
1 with a spread that varies by step, so the clip never bounds a positive-advantage update, is read from these.

    step_ratio_sums(logp_B_T, old_logp_B_T, mask_B_T, per_step) -> {name: [T]}
        the sums per step of the trained entries: count, rho = exp(logp - old_logp), rho^2, and of every per-step
        indicator a policy loss returns (``clipped``, ``dropped``: metrics named ``*_B_T``)
    add_step_sums(total, sums, metrics) -> metrics
        accumulates ``sums`` into ``total`` (a dict updated in place) and returns ``metrics`` unchanged
    step_ratio_stats(total) -> {"steps/ratio_mean/03": ..., ...}
        per trained step t (zero-padded index): the ratio's mean and std, and each indicator's fraction
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


@torch.no_grad()
def step_ratio_sums(logp_B_T: Tensor, old_logp_B_T: Tensor, mask_B_T: Tensor,
                    per_step: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Sums over the batch of each step's trained entries (module docstring), float64 on the CPU, each [T]."""
    mask = (mask_B_T > 0).double()
    log_ratio = torch.where(mask > 0, logp_B_T.double() - old_logp_B_T.double(), torch.zeros_like(mask))
    rho = torch.exp(log_ratio)
    sums = {"count": mask.sum(0), "ratio": (rho * mask).sum(0), "ratio_sq": (rho * rho * mask).sum(0)}
    for name, value in (per_step or {}).items():
        sums[name] = (value.detach().double() * mask).sum(0)
    return {k: v.cpu() for k, v in sums.items()}


def add_step_sums(total: dict[str, Tensor], sums: dict[str, Tensor] | None, metrics: dict) -> dict:
    """``total[k] += sums[k]`` for every k (``sums`` None: nothing); returns ``metrics``."""
    for k, v in (sums or {}).items():
        total[k] = total[k] + v if k in total else v.clone()
    return metrics


def step_ratio_stats(total: dict[str, Tensor]) -> dict[str, float]:
    """``steps/ratio_mean/<t>``, ``steps/ratio_std/<t>`` and ``steps/<indicator>_frac/<t>`` for every step t with a
    trained entry ({} without sums)."""
    if not total:
        return {}
    count = total["count"]
    width = len(str(max(len(count) - 1, 0)))
    out: dict[str, float] = {}
    for t in torch.nonzero(count > 0).flatten().tolist():
        n = float(count[t])
        mean = float(total["ratio"][t]) / n
        var = max(float(total["ratio_sq"][t]) / n - mean * mean, 0.0)
        key = f"{t:0{width}d}"
        out[f"steps/ratio_mean/{key}"] = mean
        out[f"steps/ratio_std/{key}"] = var ** 0.5
        for name, value in total.items():
            if name not in ("count", "ratio", "ratio_sq"):
                out[f"steps/{name}_frac/{key}"] = float(value[t]) / n
    return out
