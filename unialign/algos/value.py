"""Value-function loss and entropy for PPO."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss (Schulman et al. 2017 reference code; TRL / verl ``vf_loss``).

        V_clip = old_V + clip(V - old_V, -clip, clip)
        L_t    = 1/2 * max((V - R)^2, (V_clip - R)^2)        (no clipping when ``clip`` is None)

    All inputs [B, T]. Returns ``loss_B_T`` (0 at masked steps) and ``{"value_clip_frac"}``.
    """
    mask = mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip is None:
        loss, frac = 0.5 * unclipped, torch.zeros((), device=values.device)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped, clipped)
        frac = ((clipped > unclipped).to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
    return loss * mask, {"value_clip_frac": frac.detach()}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last axis: H = logsumexp(z) - sum softmax(z) * z. [..., V] -> [...]."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)
