"""Sample-based estimators of KL(pi || pi_ref) (Schulman, "Approximating KL divergence", 2020).

With samples from pi and r = pi_ref / pi = exp(ref_logp - logp):

    k1 = -log r = logp - ref_logp                     unbiased, high variance, can be negative
    k2 = 1/2 (log r)^2                                biased, low variance
    k3 = (r - 1) - log r                              unbiased, low variance, always >= 0

verl calls k3 ``low_var_kl`` and k2 ``mse``; TRL's GRPO uses k3.

For policies whose steps are Gaussians of the same, theta-independent variance (a DDIM step with
eta > 0, Flow-GRPO's SDE step) the KL of a step also has a closed form, ``gaussian_kl``; the policy
computes it (``log_prob_and_kl``), because it needs both means, which log-probs do not carry. The
estimator name ``"gaussian"`` selects it (``CLOSED_FORM_ESTIMATORS``). ``"gaussian_g2"`` is Flow-GRPO's variant
(Liu et al. 2025, ``scripts/train_sd3.py``): the squared mean gap over 2 g^2, g^2 the step's diffusion coefficient
rather than its variance -- for the SDE step (std^2 = g^2 |dt|) the exact KL times |dt|, for CPS (whose ``std_dev_t``
is the step's std) the exact KL. ``closed_form_kl`` applies the policy's per-step weights std^2 / g^2
(``kl_weights``). ``"prediction_mse"`` is the forward-process policies' regulariser (AWM, DiffusionNFT): mean_D of
the squared gap between the model's and the reference's predictions at the same x_t (their "uniform velocity
KL"; no Gaussian step to take a KL of).

Why it matters for images: a diffusion step's log-prob is a **mean** over its D = C*H*W elements, and
the per-element log-ratios at x' ~ pi are delta^2/(2 sigma^2) + (delta/sigma) z with delta = mu - mu_ref,
so their mean concentrates at the per-element KL with variance 2 KL / D. Then k1 estimates the
per-element KL, but k2 and k3 of that mean are about (KL^2 + 2 KL / D) / 2 -- second order, a far
weaker penalty -- and the sampled estimators' gradients have expectation 0 (k1) or ~1/D of the
closed form's (k2, k3): the recorded x' is not reparametrised. Only ``gaussian`` pulls mu towards
mu_ref at full strength (measured in ``tests/image/test_kl.py``).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

KL_ALIASES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
CLOSED_FORM_ESTIMATORS = ("gaussian", "gaussian_g2", "prediction_mse")
NEEDS_KL_WEIGHTS = ("gaussian_g2",)  # closed forms that need the policy's ``kl_weights(trajectory)``


def check_kl_estimator(estimator: str) -> None:
    """ValueError unless ``estimator`` is a sample estimator (``KL_ALIASES``) or a closed form."""
    if estimator not in KL_ALIASES and estimator not in CLOSED_FORM_ESTIMATORS:
        raise ValueError(f"kl_estimator: unknown {estimator!r}; use one of "
                         f"{sorted(KL_ALIASES) + list(CLOSED_FORM_ESTIMATORS)}")


def gaussian_kl(mean: Tensor, ref_mean: Tensor, std: Tensor | float) -> Tensor:
    """Closed-form KL(N(mean, std^2 I) || N(ref_mean, std^2 I)) per element, averaged over every
    non-batch dim (the convention of the Gaussian step log-probs): mean_D (mean - ref_mean)^2 / (2 std^2).

    ``mean``, ``ref_mean``: [B, ...]; ``std``: broadcastable to them (e.g. [B, 1, 1, 1]), > 0, the same
    for both Gaussians. Returns [B]. The KL term of Flow-GRPO (Liu et al. 2025, ``train_sd3.py``) and
    DPOK (Fan et al. 2023, eq. 10) per step; Flow-GRPO divides by its diffusion coefficient g^2 rather
    than the step variance g^2 |dt|, i.e. its value is this one times |dt|."""
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    kl = (mean - ref_mean) ** 2 / (2 * std**2)
    return kl.mean(dim=tuple(range(1, kl.dim())))


def closed_form_kl(kl_B_T: Tensor, estimator: str, weights_B_T: Tensor | None = None) -> Tensor:
    """The closed-form estimator ``estimator`` from the exact per-step KL ``kl_B_T`` [B, T]: ``gaussian`` is
    ``kl_B_T`` itself; ``gaussian_g2`` (Flow-GRPO) is ``kl_B_T * weights_B_T``, the weights std^2 / g^2 of each step
    (|dt| for Flow-GRPO's SDE step, 1 for CPS). Returns [B, T]."""
    if estimator in ("gaussian", "prediction_mse"):  # the policy's own closed form, as it computed it
        return kl_B_T
    if estimator == "gaussian_g2":
        if weights_B_T is None:
            raise ValueError("kl_estimator='gaussian_g2' needs the policy's kl_weights (a flow-matching SDE policy)")
        return kl_B_T * weights_B_T.to(kl_B_T.device, kl_B_T.dtype)
    raise ValueError(f"closed_form_kl: {estimator!r} is not one of {CLOSED_FORM_ESTIMATORS}")


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
