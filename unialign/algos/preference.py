"""Pairwise preference losses: DPO and its variants (text and Diffusion-DPO alike), Bradley-Terry.

The same ``dpo_loss`` trains a language model and a diffusion UNet. Only what the policy returns
as a sample's log-likelihood differs (see ``unialign.types``). With the diffusion ELBO surrogate
logp = -1/2 * mean_CHW ||eps - eps_theta||^2 and beta = 5000 this is exactly the Diffusion-DPO
reference loss (Wallace et al. 2023): ln 2 at initialisation, derivative beta/4 there. The variants
are registered functions (``unialign.algos.pair_losses``); ``dpo_loss`` looks them up by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unialign.algos.pair_losses import PAIR_LOSSES, check_pair_loss_params

Tensor = torch.Tensor

# the DPO family's loss functions with a reference (TRL's loss_type names); "rpo" is sigmoid plus the chosen NLL
DPO_LOSS_TYPES = tuple(n for n, e in PAIR_LOSSES.items() if e.needs_reference and not e.nll_coef)
# the registered losses without a reference model (SimPO, ORPO)
REFERENCE_FREE_LOSSES = tuple(n for n, e in PAIR_LOSSES.items() if not e.needs_reference)


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    **params: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair losses of the registered pair loss ``loss_type`` (``algos.pair_losses.PAIR_LOSSES``).
    All inputs [B]; returns (losses_B, chosen_rewards_B, rejected_rewards_B).

    With h = (log pi(y_w) - log pi(y_l)) - (log pi_ref(y_w) - log pi_ref(y_l)) and eps = label_smoothing:

      sigmoid  -(1-eps) log sigma(beta h) - eps log sigma(-beta h)
               DPO (Rafailov et al. 2023, eq. 7); eps > 0 is conservative DPO (cDPO, Mitchell 2023).
      ipo      (h - 1/(2 beta))^2                      IPO (Azar et al. 2023, eq. 17). Pass
               length-averaged log-probs, as the paper and TRL do.
      hinge    max(0, 1 - beta h)                      SLiC-HF (Zhao et al. 2023, eq. 3), beta = 1/delta.
      robust   [-(1-eps) log sigma(beta h) + eps log sigma(-beta h)] / (1 - 2 eps)
               robust DPO (Chowdhury et al. 2024, eq. 10), unbiased under label-flip rate eps < 1/2.

    Reference-free entries (``simpo``, ``orpo``; pass ``ref_*`` None) take the policy's length-averaged
    log-likelihoods and their own ``params`` (SimPO's ``gamma``). The chosen-side NLL that RPO / ORPO add
    is the caller's (``chosen_nll_loss``, weight ``PAIR_LOSSES[name].nll_coef``). The implicit rewards are
    beta * (log pi - log pi_ref) of each side (beta * log pi without a reference), detached.
    """
    entry = check_pair_loss_params(loss_type, label_smoothing, **params)
    given = (ref_chosen_logps is not None, ref_rejected_logps is not None)
    if given != (entry.needs_reference,) * 2:
        need = "needs both" if entry.needs_reference else "is reference-free: pass None for"
        raise ValueError(f"loss_type {loss_type!r} {need} ref_chosen_logps and ref_rejected_logps")
    chosen, rejected = chosen_logps, rejected_logps
    if entry.needs_reference:
        chosen, rejected = chosen - ref_chosen_logps, rejected - ref_rejected_logps
    if "label_smoothing" in entry.params:
        params = {**params, "label_smoothing": label_smoothing}
    losses = entry.fn(chosen, rejected, beta, **params)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def bradley_terry_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | None = None, center_coef: float = 0.0
) -> Tensor:
    """Per-pair Bradley-Terry reward-model loss (Ouyang et al. 2022, eq. 1; margin as Llama 2, eq. 2).

        L = -log sigma(r_w - r_l - m) + center_coef * (r_w + r_l)^2

    The centring term (Eisenstein et al. 2023; TRL ``center_rewards_coefficient``) pulls rewards to
    mean zero; its batch mean equals TRL's ``mean((r_w + r_l)^2)``. Inputs [B]; returns losses [B].
    """
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    losses = -F.logsigmoid(diff)
    if center_coef:
        losses = losses + center_coef * (chosen_rewards + rejected_rewards) ** 2
    return losses
