"""Importance-sampling correction for a rollout engine whose log-probs differ from the trainer's.

An inference engine (vLLM, or a low-precision copy of the policy) samples from pi_rollout, which is not
exactly the trainer's pi_old: different kernels, dtype, batch invariance. The policy-gradient loss is an
expectation under pi_old, so each token's loss is re-weighted by w = pi_old / pi_rollout, truncated
(TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training") or
masked when the ratio is too large (MIS / ICEPOP: Liu et al. 2025, "When Speed Kills Stability"). The
same corrections exist as TRL's ``vllm_importance_sampling_correction``, verl's rollout correction and
OpenRLHF's TIS.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
ROLLOUT_CORRECTION_MODES = ("truncate", "mask")


def rollout_correction(
    old_logp_B_T: Tensor,
    rollout_logp_B_T: Tensor,
    mask_B_T: Tensor,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token importance weights pi_old / pi_rollout, detached, to multiply the per-token policy loss.

    * ``level="token"``: r_t = exp(old_t - rollout_t).
    * ``level="sequence"``: r_t = exp(sum_t' mask_t' * (old_t' - rollout_t')) for every token of the
      sequence (the product of its token ratios).
    * ``mode="truncate"`` (TIS): w_t = min(r_t, cap); ``mode="mask"`` (MIS): w_t = r_t if r_t <= cap else 0.

    Computed in log space in float64 (a sequence's summed log-ratio may exceed float32's exp range), so
    the weights are finite for any input: an infinite log-ratio gives ``cap`` (truncate) or 0, a NaN one
    (a broken engine log-prob) gives 0 and counts as clipped. Shapes: all [B, T]; ``mask_B_T`` 1 for trained tokens.
    Returns ``weights_B_T`` (float32 unless the inputs are float64; 0 at masked tokens) and detached
    metrics over the masked tokens: ``mismatch_mean`` / ``mismatch_max`` (mean / max finite |old - rollout|),
    ``weight_mean``, ``clipped_frac`` (tokens whose ratio exceeded ``cap``: truncated, or zeroed in
    ``mask`` mode; at sequence level every token of such a sequence counts).
    """
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(f"rollout correction level must be one of {ROLLOUT_CORRECTION_LEVELS}, got {level!r}")
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"rollout correction mode must be one of {ROLLOUT_CORRECTION_MODES}, got {mode!r}")
    if not cap > 0 or not math.isfinite(cap):
        raise ValueError(f"rollout correction cap must be a finite number > 0, got {cap}")
    if old_logp_B_T.shape != rollout_logp_B_T.shape or old_logp_B_T.shape != mask_B_T.shape:
        raise ValueError(f"shapes differ: old {tuple(old_logp_B_T.shape)}, rollout {tuple(rollout_logp_B_T.shape)}, "
                         f"mask {tuple(mask_B_T.shape)}")
    out_dtype = torch.float64 if old_logp_B_T.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        mask = mask_B_T.detach().double() > 0
        diff = torch.where(mask, old_logp_B_T.detach().double() - rollout_logp_B_T.detach().double(),
                           torch.zeros((), dtype=torch.float64, device=mask.device))
        log_r = diff if level == "token" else diff.sum(-1, keepdim=True).expand_as(diff)
        log_cap = math.log(cap)
        broken = torch.isnan(log_r) & mask  # an engine's NaN log-prob: weight 0 in either mode, counted
        over = ((log_r > log_cap) & mask) | broken
        w = torch.exp(torch.nan_to_num(log_r, nan=0.0).clamp(max=log_cap))  # +inf -> cap, -inf -> 0
        if mode == "mask":
            w = torch.where(over, torch.zeros_like(w), w)
        w = torch.where(mask & ~broken, w, torch.zeros_like(w))
        n = mask.sum().clamp(min=1)
        absdiff = torch.where(torch.isfinite(diff), diff.abs(), torch.zeros_like(diff))
        metrics = {
            "mismatch_mean": absdiff.sum() / n,
            "mismatch_max": absdiff.max() if mask.any() else absdiff.new_zeros(()),
            "weight_mean": w.sum() / n,
            "clipped_frac": over.double().sum() / n,
        }
    return w.to(out_dtype), {k: v.float() for k, v in metrics.items()}
