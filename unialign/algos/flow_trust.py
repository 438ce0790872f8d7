"""Trust regions for the SDE steps of flow-matching RL (Flow-GRPO's per-step Gaussian transitions), 2026:

    ratio_norm(log_ratio_B_T, mean_gap_sq_B_T, step_std_B_T) -> log_rho_B_T
        GRPO-Guard's RatioNorm (arXiv 2510.22319; verl-project/verl-omni ``GRPOGuardLoss``): Flow-GRPO's per-step
        log-ratios have means below 0 and a per-step spread, so the clip never bounds a positive-advantage update;
        with m = mean_D (mu_theta - mu_old)^2 and s the step's std,
            log rho_hat = s (log_ratio + m / (2 s^2))
        -- the log-ratio's mean shift m / (2 s^2) removed and its scale 1 / s undone.
    guard_step_weight(dt_B_T) -> w_B_T = 1 / (-dt)
        GRPO-Guard's reweighting of each step's loss by the inverse of its (negative) time step.
    dppo_mask(log_ratio_B_T, mean_B_T_D, old_mean_B_T_D, step_std_B_T, advantages_B, kl_threshold) -> keep_B_T
        Flow-DPPO's trust region (arXiv 2606.11025; Tencent-Hunyuan/UniRL ``flowdppo.py``): the exact Gaussian KL of
        the trained and the old step, kl = mean_D (mu_theta - mu_old)^2 / (2 s^2); a step with kl >= delta whose
        ratio moves in its advantage's direction ((rho > 1 and A > 0) or (rho < 1 and A < 0)) is dropped. The loss
        is -A rho on the kept steps, unclipped; no gradient flows through the mask.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _mean_D(x: Tensor) -> Tensor:
    """Mean over every dim after the first two ([B, T, ...] -> [B, T])."""
    return x.flatten(2).mean(-1) if x.dim() > 2 else x


def ratio_norm(log_ratio_B_T: Tensor, mean_gap_sq_B_T: Tensor, step_std_B_T: Tensor) -> Tensor:
    """RatioNorm's log-ratio (module docstring); ``mean_gap_sq_B_T`` = mean_D (mu_theta - mu_old)^2, ``step_std_B_T``
    the SDE step's std s (> 0)."""
    s = step_std_B_T.to(log_ratio_B_T.dtype)
    return s * (log_ratio_B_T + mean_gap_sq_B_T / (2 * s * s))


def guard_step_weight(dt_B_T: Tensor) -> Tensor:
    """1 / (-dt) per step (dt < 0: the sampler runs from noise, t = 1, to data, t = 0)."""
    return 1.0 / (-dt_B_T)


@torch.no_grad()
def dppo_mask(log_ratio_B_T: Tensor, mean_B_T_D: Tensor, old_mean_B_T_D: Tensor, step_std_B_T: Tensor,
              advantages_B: Tensor, kl_threshold: float) -> Tensor:
    """Flow-DPPO's kept steps, bool [B, T] (module docstring); ``mean_B_T_D`` / ``old_mean_B_T_D`` the trained and the
    old step's Gaussian means [B, T, ...], ``advantages_B`` [B] (or [B, T])."""
    s = step_std_B_T.to(mean_B_T_D.dtype)
    kl = _mean_D((mean_B_T_D - old_mean_B_T_D) ** 2) / (2 * s * s)
    A = advantages_B if advantages_B.dim() == 2 else advantages_B.unsqueeze(-1)
    away = ((log_ratio_B_T > 0) & (A > 0)) | ((log_ratio_B_T < 0) & (A < 0))
    return ~((kl >= kl_threshold) & away)
