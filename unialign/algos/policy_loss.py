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
            "clipped_B_T": (low + high) * mask,
        }
    return loss, metrics


# ----------------------------------------------------------------------------- registry
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str, inputs: tuple[str, ...] = (),
                         whole_groups: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator over ``fn(logp_B_T, old_logp_B_T, advantages, mask_B_T, spec, **terms) -> (loss_B_T, metrics)``;
    ``spec`` is any object with the ``AlgoSpec`` fields the loss reads. The trainer looks the preset's
    ``policy_loss`` up here (verl's ``register_policy_loss``). ``inputs``: names of extra per-step terms the loss
    reads, which the policy computes beside its log-probs (``log_prob_terms``; e.g. DiffusionNFT's ``"nft"``); a
    policy without them is refused when the trainer starts. They arrive as keyword arguments (``fn.inputs``).
    ``whole_groups``: the loss couples the samples of a group (DGPO's group score), so the trainer hands it
    micro-batches of whole groups, contiguous, and ``group_size=G`` (``fn.whole_groups``).

    Metrics whose name ends in ``_B_T`` are per-step tensors (e.g. ``clipped_B_T``: where the clip held the
    ratio), which the trainer reduces per trajectory step; every other metric is a scalar."""
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        add_new(POLICY_LOSSES, name, fn, "policy loss")
        fn.inputs, fn.whole_groups = tuple(inputs), whole_groups
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


def _live_gauss(mask: Tensor, step_gauss: tuple[Tensor, Tensor, Tensor, Tensor]) -> tuple[Tensor, ...]:
    """``step_gauss`` (mean, old mean, std, dt) with a masked step's std and dt set to 1 and -1 (the last CPS step
    has std 0: never trained, never divided by)."""
    mean, old_mean, std, dt = step_gauss
    live = mask > 0
    return (mean, old_mean.detach(), torch.where(live, std.to(mean.dtype), torch.ones_like(std, dtype=mean.dtype)),
            torch.where(live, dt.to(mean.dtype), -torch.ones_like(dt, dtype=mean.dtype)))


@register_policy_loss("grpo_guard", inputs=("step_gauss",))
def _grpo_guard(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, spec: Any,
                step_gauss: tuple[Tensor, Tensor, Tensor, Tensor]):
    """GRPO-Guard (arXiv 2510.22319; verl-project/verl-omni ``GRPOGuardLoss``): PPO's clip (``spec.epsilon``) on
    RatioNorm's ratio ``unialign.algos.flow_trust.ratio_norm`` with m = mean_D (mu_theta - mu_old)^2 (differentiable
    through mu_theta), each step's loss times ``guard_step_weight(dt)`` = 1 / |dt|. ``step_gauss``: (mean, old
    mean [B, T, ...], std [B, T], dt [B, T]) from the policy (a flow policy's SDE steps)."""
    from unialign.algos.flow_trust import _mean_D, guard_step_weight, ratio_norm

    mean, old_mean, std, dt = _live_gauss(mask, step_gauss)
    log_ratio = torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp))
    log_rho = ratio_norm(log_ratio, _mean_D((mean - old_mean) ** 2).to(logp.dtype), std.to(logp.dtype))
    loss, metrics = clipped_policy_loss(log_rho, torch.zeros_like(log_rho), advantages, mask, spec.epsilon,
                                        spec.epsilon_high)
    metrics["ratio_norm_mean"] = metrics.pop("ratio_mean")
    metrics["ratio_mean"] = _masked_mean(torch.exp(log_ratio.detach()), mask)
    return loss * guard_step_weight(dt).to(loss.dtype), metrics


@register_policy_loss("flow_dppo", inputs=("step_gauss",))
def _flow_dppo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, spec: Any,
               step_gauss: tuple[Tensor, Tensor, Tensor, Tensor]):
    """Flow-DPPO (arXiv 2606.11025; Tencent-Hunyuan/UniRL ``flowdppo.py``, verl-omni ``FlowDPPOLoss``): -A rho on the
    steps ``unialign.algos.flow_trust.dppo_mask`` keeps at ``spec.kl_mask_threshold``, unclipped; 0 on the dropped
    ones (``dropped_B_T``). ``step_gauss`` as for ``grpo_guard``."""
    from unialign.algos.flow_trust import _mean_D, dppo_mask

    mean, old_mean, std, _ = _live_gauss(mask, step_gauss)
    mask = mask.to(logp.dtype)
    adv = (advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages).to(logp.dtype).expand_as(logp)
    log_ratio = torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp))
    keep = dppo_mask(log_ratio.detach(), mean.detach(), old_mean, std, adv, spec.kl_mask_threshold)
    rho = torch.exp(log_ratio)
    loss = torch.where(keep, -adv * rho, torch.zeros_like(rho)) * mask
    with torch.no_grad():
        dropped = (~keep).to(mask.dtype) * mask
        kl = _mean_D((mean.detach() - old_mean) ** 2) / (2 * std * std)
        metrics = {"ratio_mean": _masked_mean(rho.detach(), mask), "dropped_frac": _masked_mean(dropped, mask),
                   "kl_old_mean": _masked_mean(kl.to(mask.dtype), mask), "dropped_B_T": dropped}
    return loss, metrics


@register_policy_loss("dgpo", inputs=("dgpo",), whole_groups=True)
def _dgpo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, spec: Any,
          dgpo: tuple[Tensor, Tensor], group_size: int):
    """DGPO (Luo, Hu & Tang, ICLR 2026; Luo-Yihong/DGPO ``compute_group_dgpo_loss_allreduce``):
    ``unialign.algos.forward.dgpo_loss`` with err = -logp (the matching log-prob; DGPO's velocity MSE under the
    "uniform" weighting), ref_err and old_err from the policy's ``"dgpo"`` term (the reference's and the old
    policy's log-probs at the same pairs), ``spec.dgpo_beta`` and the clip ``spec.epsilon``. Micro-batches of whole
    groups of ``group_size`` samples, contiguous, each group's K pairs shared (``[B, K]``); ``advantages`` per
    sample ([B] or its [B, K] expansion)."""
    from unialign.algos.forward import dgpo_loss

    ref_logp, ema_logp = (t.detach().to(logp.dtype) for t in dgpo)
    adv = advantages[:, 0] if advantages.dim() == 2 else advantages
    mask = mask.to(logp.dtype)
    loss = dgpo_loss(-logp, -ref_logp, adv.to(logp.dtype), group_size, spec.dgpo_beta, -ema_logp, spec.epsilon)
    with torch.no_grad():
        A = adv.to(logp.dtype).unsqueeze(-1).expand_as(logp)
        rho = torch.exp(logp.detach() - ema_logp)
        held = (((A > 0) & (rho > 1 + spec.epsilon)) | ((A <= 0) & (rho < 1 - spec.epsilon))).to(mask.dtype) * mask
        metrics = {"ratio_mean": _masked_mean(rho, mask), "clip_frac": _masked_mean(held, mask), "clipped_B_T": held}
    return loss * mask, metrics
