"""Reward shaping: DAPO's soft overlong punishment, per-token KL-in-reward (InstructGPT / PPO-RLHF),
and the adaptive KL controller of Ziegler et al. 2019."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def overlong_penalty(lengths_B: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the task reward.

        0                                  if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                                 if |y| > L_max

    ``lengths_B``: completion lengths [B]. Returns float [B] in [-1, 0].
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = lengths_B.to(torch.float32)
    start = max_len - cache_len
    ramp = (start - lengths) / cache_len
    return torch.where(lengths <= start, torch.zeros_like(lengths), torch.where(lengths <= max_len, ramp, -torch.ones_like(lengths)))


def kl_shaped_rewards(scores_B: Tensor, kl_B_T: Tensor, mask_B_T: Tensor, kl_coef: float) -> Tensor:
    """Per-step rewards with the KL penalty in the reward (Stiennon et al. 2020, eq. 1; InstructGPT):

        r_t = -kl_coef * KL_t  on every unmasked step,  plus the sequence score at the last unmasked step.

    ``scores_B``: [B]; ``kl_B_T`` (e.g. ``kl_estimate(logp, ref_logp, "k1")``), ``mask_B_T``: [B, T].
    Returns rewards [B, T], 0 at masked steps. A row with no unmasked step gets no score.
    """
    mask = mask_B_T.to(kl_B_T.dtype)
    rewards = -kl_coef * kl_B_T.detach() * mask
    T = mask.shape[1]
    last = (mask * torch.arange(1, T + 1, device=mask.device, dtype=mask.dtype)).argmax(-1)  # last unmasked index
    has_step = mask.sum(-1) > 0
    bonus = torch.zeros_like(rewards).scatter(1, last.unsqueeze(-1), scores_B.to(rewards.dtype).unsqueeze(-1))
    return rewards + bonus * has_step.unsqueeze(-1).to(rewards.dtype)


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, eq. 2; TRL / verl ``AdaptiveKLController``):

        e = clip(KL / target - 1, -0.2, 0.2);   beta <- beta * (1 + e * n_steps / horizon)

    With ``target=None`` the coefficient stays fixed.
    """

    def __init__(self, init_kl_coef: float, target: float | None = None, horizon: int = 10000):
        if target is not None and target <= 0:
            raise ValueError(f"KL target must be > 0, got {target}")
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        if self.target is not None:
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = state["value"], state["target"], state["horizon"]
