"""Pairwise preference losses: DPO and its variants (text and Diffusion-DPO alike), Bradley-Terry.

The same ``dpo_loss`` trains a language model and a diffusion UNet. Only what the policy returns
as a sample's log-likelihood differs (see ``unialign.types``). With the diffusion ELBO surrogate
logp = -1/2 * mean_CHW ||eps - eps_theta||^2 and beta = 5000 this is exactly the Diffusion-DPO
reference loss (Wallace et al. 2023): ln 2 at initialisation, derivative beta/4 there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair DPO-family losses. All inputs [B]; returns (losses_B, chosen_rewards_B, rejected_rewards_B).

    With h = (log pi(y_w) - log pi(y_l)) - (log pi_ref(y_w) - log pi_ref(y_l)) and eps = label_smoothing:

      sigmoid  -(1-eps) log sigma(beta h) - eps log sigma(-beta h)
               DPO (Rafailov et al. 2023, eq. 7); eps > 0 is conservative DPO (cDPO, Mitchell 2023).
      ipo      (h - 1/(2 beta))^2                      IPO (Azar et al. 2023, eq. 17). Pass
               length-averaged log-probs, as the paper and TRL do.
      hinge    max(0, 1 - beta h)                      SLiC-HF (Zhao et al. 2023, eq. 3), beta = 1/delta.
      robust   [-(1-eps) log sigma(beta h) + eps log sigma(-beta h)] / (1 - 2 eps)
               robust DPO (Chowdhury et al. 2024, eq. 10), unbiased under label-flip rate eps < 1/2.

    The implicit rewards are beta * (log pi - log pi_ref) of each side, detached.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type not in ("sigmoid", "robust"):
        raise ValueError(f"label_smoothing applies to 'sigmoid' (cDPO) and 'robust' only, not {loss_type!r}")
    h = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) / (
            1 - 2 * label_smoothing
        )
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


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
