"""Clipped importance-ratio policy losses: PPO, DAPO clip-higher, dual clip, GSPO and GSPO-token.

One function covers them all; the variants are arguments, not copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unialign.algos.named import add_new, lookup

Tensor = torch.Tensor

RATIO_LEVELS = ("token", "sequence", "sequence_token")


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def sequence_log_ratio(log_ratio_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """GSPO's length-normalised sequence log-ratio, [B, 1]:
    log s_i = 1/|y_i| * sum_t mask * (log pi(y_t) - log pi_old(y_t)); 0 for an all-masked row."""
    return (log_ratio_B_T * mask_B_T).sum(-1, keepdim=True) / mask_B_T.sum(-1, keepdim=True).clamp(min=1)


def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float | None = None,
    ratio_level: str = "token",
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate as a per-step loss to minimise (Schulman et al. 2017, eq. 7).

        L_t = max(-A_t * rho_t, -A_t * clip(rho_t, 1 - eps_low, 1 + eps_high))

    * ``eps_high`` (DAPO clip-higher, Yu et al. 2025, eq. 10): upper bound; ``None`` means ``eps_low``.
    * ``dual_clip`` c > 1 (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5): for
      A_t < 0 the loss is further capped, L_t = min(L_t, -c * A_t).
    * ``ratio_level``:
        - ``"token"``: rho_t = pi(y_t) / pi_old(y_t) per step.
        - ``"sequence"`` (GSPO, Zheng et al. 2025, eq. 7): rho_t = s_i = exp(mean_t log-ratio) for
          every step of sample i; with ``seq_mean_token_mean`` aggregation this is GSPO's objective.
        - ``"sequence_token"`` (GSPO-token, eq. 13): rho_t = sg[s_i] * pi(y_t) / sg[pi(y_t)], equal to
          s_i in value, with per-token gradients (so per-token advantages are possible).

    Shapes: ``logp``, ``old_logp``, ``mask``: [B, T]; ``advantages``: [B] or [B, T].
    Returns ``loss_B_T`` (0 at masked steps) and detached metrics: ``clip_frac_low`` (rho below
    1 - eps_low with A < 0), ``clip_frac_high`` (rho above 1 + eps_high with A > 0), ``clip_frac``
    (their sum), ``dual_clip_frac``, ``ratio_mean``, ``approx_kl`` (masked mean of k3 of old vs new).
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    eps_high = eps_low if eps_high is None else eps_high
    mask = mask.to(logp.dtype)
    adv_B_T = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    adv_B_T = adv_B_T.to(logp.dtype).expand_as(logp)

    # masked steps get log-ratio 0 *before* exp, so padding garbage can never turn into inf * 0 = NaN
    log_ratio = torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp))
    if ratio_level == "token":
        log_rho = log_ratio
    elif ratio_level == "sequence":
        log_rho = sequence_log_ratio(log_ratio, mask).expand_as(logp)
    else:
        log_rho = sequence_log_ratio(log_ratio, mask).detach() + log_ratio - log_ratio.detach()
    rho = torch.exp(log_rho)
    clipped_rho = torch.clamp(rho, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(-adv_B_T * rho, -adv_B_T * clipped_rho)
    capped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -adv_B_T * dual_clip
        capped = (adv_B_T < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
    loss = loss * mask

    with torch.no_grad():
        low = ((rho < 1.0 - eps_low) & (adv_B_T < 0)).to(mask.dtype)
        high = ((rho > 1.0 + eps_high) & (adv_B_T > 0)).to(mask.dtype)
        metrics = {
            "clip_frac_low": _masked_mean(low, mask),
            "clip_frac_high": _masked_mean(high, mask),
            "clip_frac": _masked_mean(low + high, mask),
            "dual_clip_frac": _masked_mean(capped.to(mask.dtype), mask),
            "ratio_mean": _masked_mean(rho.detach(), mask),
            "approx_kl": _masked_mean(torch.expm1(-log_ratio.detach()) + log_ratio.detach(), mask),
        }
    return loss, metrics


# ----------------------------------------------------------------------------- registry
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str, inputs: tuple[str, ...] = ()) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator over ``fn(logp_B_T, old_logp_B_T, advantages, mask_B_T, spec, **terms) -> (loss_B_T, metrics)``;
    ``spec`` is any object with the ``AlgoSpec`` fields the loss reads. The trainer looks the preset's
    ``policy_loss`` up here (verl's ``register_policy_loss``). ``inputs``: names of extra per-step terms the loss
    reads, which the policy computes beside its log-probs (``log_prob_terms``; e.g. DiffusionNFT's ``"nft"``); a
    policy without them is refused when the trainer starts. They arrive as keyword arguments (``fn.inputs``)."""
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        add_new(POLICY_LOSSES, name, fn, "policy loss")
        fn.inputs = tuple(inputs)
        return fn
    return add


def get_policy_loss(name: str) -> PolicyLossFn:
    return lookup(POLICY_LOSSES, name, "policy loss")


@register_policy_loss("clipped")
def _clipped(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, spec: Any):
    """``clipped_policy_loss`` with the spec's clip bounds, ratio level and dual clip (PPO, DAPO, GSPO, ...)."""
    return clipped_policy_loss(logp, old_logp, advantages, mask, spec.epsilon, spec.epsilon_high,
                               spec.importance_sampling_level, spec.dual_clip)


@register_policy_loss("nft", inputs=("nft",))
def _nft(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, spec: Any, nft: tuple[Tensor, Tensor]):
    """DiffusionNFT (Zheng et al. 2025; NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``): per trained pair the
    loss ``unialign.algos.forward.nft_loss_terms`` with r = ``nft_weight(A, advantage_clip)`` and beta =
    ``spec.nft_beta``, times A_max as the reference scales it; no ratio, no clip (``logp`` / ``old_logp`` only
    feed the metrics). ``nft``: (old_err, delta) [B, T, C, H, W] from the policy."""
    from unialign.algos.forward import nft_loss_terms, nft_weight

    old_err, delta = nft
    b, t = mask.shape
    a_max = spec.advantage_clip if spec.advantage_clip is not None else 1.0
    adv = advantages.unsqueeze(-1).expand(b, t) if advantages.dim() == 1 else advantages
    r = nft_weight(adv.reshape(-1).float(), a_max)
    flat = nft_loss_terms(old_err.reshape(b * t, -1), delta.reshape(b * t, -1), r, spec.nft_beta)
    loss = (a_max * flat.view(b, t)).to(logp.dtype) * mask
    with torch.no_grad():
        metrics = {"nft_r_mean": _masked_mean(r.view(b, t).to(mask.dtype), mask),
                   "ratio_mean": _masked_mean(torch.exp(logp.detach() - old_logp.detach()), mask)}
    return loss, metrics
