"""Sample-based estimators of KL(pi || pi_ref) (Schulman, "Approximating KL divergence", 2020).

With samples from pi and r = pi_ref / pi = exp(ref_logp - logp):

    k1 = -log r = logp - ref_logp                     unbiased, high variance, can be negative
    k2 = 1/2 (log r)^2                                biased, low variance
    k3 = (r - 1) - log r                              unbiased, low variance, always >= 0

verl calls k3 ``low_var_kl`` and k2 ``mse``; TRL's GRPO uses k3.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

KL_ALIASES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3", clamp: float | None = None) -> Tensor:
    """Per-element estimate of KL(pi || pi_ref) from log-probs of samples drawn from pi.

    ``logp``, ``ref_logp``: same shape (e.g. [B, T]). Returns that shape. ``clamp`` optionally
    bounds the log-ratio to [-clamp, clamp] first (verl uses 20) to keep k3's exp finite; the
    default applies the exact formula. Gradients flow through ``logp`` (and ``ref_logp`` if it
    requires grad).
    """
    name = KL_ALIASES.get(estimator)
    if name is None:
        raise ValueError(f"unknown KL estimator {estimator!r}; use one of {sorted(KL_ALIASES)}")
    log_ratio = logp - ref_logp  # log pi - log pi_ref = -log r
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if name == "k1":
        return log_ratio
    if name == "k2":
        return 0.5 * log_ratio**2
    return torch.expm1(-log_ratio) + log_ratio
