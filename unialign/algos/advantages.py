"""Advantage math, pure functions the registered estimators (``advantage_estimators``) call: group-relative (GRPO /
Dr.GRPO), RLOO, per-prompt tracking (DDPO), GAE (PPO).

All functions are pure; shapes are in each docstring. Rewards that are not finite (NaN / inf,
e.g. a reward function that returned ``None``) are excluded from every baseline and get
advantage 0, so one bad sample never poisons its group.
"""

from __future__ import annotations

from collections import deque

import torch

Tensor = torch.Tensor


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"batch of {rewards.numel()} rewards is not a whole number of groups of {group_size}")
    return rewards.reshape(-1, group_size)


def _masked_mean_std(x: Tensor, valid: Tensor, dim: int | None, unbiased: bool) -> tuple[Tensor, Tensor]:
    """Mean and std of ``x`` over ``valid`` entries (0 where there are too few)."""
    xv = torch.where(valid, x, torch.zeros_like(x))
    n = valid.sum(dim=dim, keepdim=dim is not None).to(x.dtype)
    mean = xv.sum(dim=dim, keepdim=dim is not None) / n.clamp(min=1)
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum(dim=dim, keepdim=dim is not None)
    dof = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    std = torch.where(n > (1 if unbiased else 0), (sq / dof).sqrt(), torch.zeros_like(sq))
    return mean, std


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath, eq. for outcome supervision).

        A_i = (r_i - mean_g(r)) / (std + eps)

    ``rewards``: [B] with B = P*G, the G samples of a prompt contiguous. ``scale``:
      * ``"group"``: std = the group's sample standard deviation (unbiased, N-1), as GRPO / TRL.
      * ``"batch"``: std = the whole batch's sample std ("Lite PPO"; TRL ``scale_rewards="batch"``).
      * ``"none"``: no division, only centring (Dr.GRPO, Liu et al. 2025).
    A group with zero variance gets advantages 0 (never NaN). Returns [B].
    """
    r_P_G = _grouped(rewards, group_size)
    valid = torch.isfinite(r_P_G)
    mean_P_1, std_P_1 = _masked_mean_std(r_P_G, valid, dim=1, unbiased=True)
    centred = r_P_G - mean_P_1
    if scale == "group":
        adv = centred / (std_P_1 + eps)
    elif scale == "batch":
        _, std = _masked_mean_std(r_P_G.reshape(-1), valid.reshape(-1), dim=None, unbiased=True)
        adv = centred / (std + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return torch.where(valid, adv, torch.zeros_like(adv)).reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, eq. 7).

        A_i = r_i - 1/(k-1) * sum_{j != i} r_j        (k = finite rewards in the group)

    ``rewards``: [B], groups of ``group_size`` contiguous. Returns [B]; a group with fewer than two
    finite rewards gets 0.
    """
    r_P_G = _grouped(rewards, group_size)
    valid = torch.isfinite(r_P_G)
    rv = torch.where(valid, r_P_G, torch.zeros_like(r_P_G))
    k = valid.sum(dim=1, keepdim=True).to(rewards.dtype)
    baseline = (rv.sum(dim=1, keepdim=True) - rv) / (k - 1).clamp(min=1)
    adv = torch.where(valid & (k > 1), rv - baseline, torch.zeros_like(rv))
    return adv.reshape(-1)


def preferences_from_scores(scores_P_G: Tensor) -> Tensor:
    """Pairwise preferences of a score compared within each group: ``pref[p, i, j]`` = 1 if ``s_i > s_j``,
    0.5 if equal, 0 if lower; NaN where either score is not finite. [P, G] -> [P, G, G]."""
    s_i, s_j = scores_P_G.unsqueeze(-1), scores_P_G.unsqueeze(-2)
    pref = (s_i > s_j).to(scores_P_G.dtype) + 0.5 * (s_i == s_j).to(scores_P_G.dtype)
    valid = torch.isfinite(s_i) & torch.isfinite(s_j)
    return torch.where(valid, pref, torch.full_like(pref, float("nan")))


def win_rates(pref_P_G_G: Tensor) -> Tensor:
    """Pref-GRPO's win rate (Wang et al. 2025, arXiv 2508.20751, eq. 6): each sample's mean preference over the
    other samples of its group,

        w_i = 1 / (k_i - 1) * sum_{j != i} pref[i, j]       (k_i - 1 = the finite pref[i, j], j != i)

    ``pref_P_G_G[p, i, j]``: the probability (or 0 / 0.5 / 1 verdict) that sample i beats sample j, NaN for a
    pair not judged; the diagonal is ignored. Returns [P, G]; NaN for a sample with no judged pair. Replacing
    scores by win rates keeps only the group's order: a 0.001 gap in a reward model's score, blown up by the
    std normalisation to a full unit of advantage (the "illusory advantage"), becomes one win out of G - 1."""
    G = pref_P_G_G.shape[-1]
    off = ~torch.eye(G, dtype=torch.bool, device=pref_P_G_G.device)
    valid = torch.isfinite(pref_P_G_G) & off
    total = torch.where(valid, pref_P_G_G, torch.zeros_like(pref_P_G_G)).sum(-1)
    n = valid.sum(-1)
    return torch.where(n > 0, total / n.clamp(min=1).to(total.dtype), torch.full_like(total, float("nan")))


class PerPromptStatTracker:
    """DDPO's per-prompt reward normaliser (Black et al. 2023; ddpo-pytorch ``stat_tracking.py``).

    For each prompt string a rolling buffer (``deque(maxlen=buffer_size)``) persists across
    epochs. ``update`` first extends each prompt's buffer with the new rewards, then normalises
    them by the buffer's mean and population std (+1e-6). While a buffer holds fewer than
    ``min_count`` rewards, the mean and population std of the whole batch are used instead.
    Non-finite rewards are not added to buffers and get advantage 0.
    """

    def __init__(self, buffer_size: int, min_count: int):
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.stats: dict[str, deque] = {}

    def update(self, prompts: list[str], rewards: Tensor) -> Tensor:
        """``prompts``: list[B]; ``rewards``: [B]. Returns advantages [B] (float64 math, rewards' dtype)."""
        if len(prompts) != rewards.numel():
            raise ValueError(f"{len(prompts)} prompts for {rewards.numel()} rewards")
        r = rewards.detach().to(torch.float64).cpu().reshape(-1)
        valid = torch.isfinite(r)
        batch_mean, batch_std = _masked_mean_std(r, valid, dim=None, unbiased=False)
        adv = torch.zeros_like(r)
        for prompt in dict.fromkeys(prompts):
            idx = torch.tensor([i for i, p in enumerate(prompts) if p == prompt])
            idx = idx[valid[idx]]
            buf = self.stats.setdefault(prompt, deque(maxlen=self.buffer_size))
            buf.extend(r[idx].tolist())
            if len(buf) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                b = torch.tensor(list(buf), dtype=torch.float64)
                mean, std = b.mean(), b.std(unbiased=False)
            adv[idx] = (r[idx] - mean) / (std + 1e-6)
        return adv.to(device=rewards.device, dtype=rewards.dtype)

    def state_dict(self) -> dict:
        return {"buffer_size": self.buffer_size, "min_count": self.min_count,
                "stats": {k: list(v) for k, v in self.stats.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.buffer_size, self.min_count = state["buffer_size"], state["min_count"]
        self.stats = {k: deque(v, maxlen=self.buffer_size) for k, v in state["stats"].items()}


def gae(rewards_B_T: Tensor, values_B_T: Tensor, mask_B_T: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16).

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                          (the value target)

    Masked steps (``mask_B_T == 0``) are skipped: their reward and value are ignored and the
    recursion passes through them (verl's convention, which also covers right padding: the
    episode ends after the last unmasked step, with V = 0 beyond it). Advantages and returns
    are 0 at masked steps. Inputs [B, T]; returns (advantages_B_T, returns_B_T), no gradient.
    """
    rewards_B_T, values_B_T = rewards_B_T.detach(), values_B_T.detach()
    mask = mask_B_T.to(values_B_T.dtype)
    next_value = torch.zeros_like(values_B_T[:, 0])
    next_adv = torch.zeros_like(values_B_T[:, 0])
    adv_steps = []
    for t in reversed(range(rewards_B_T.shape[1])):
        delta = rewards_B_T[:, t] + gamma * next_value - values_B_T[:, t]
        adv_t = delta + gamma * lam * next_adv
        m = mask[:, t]
        next_adv = m * adv_t + (1 - m) * next_adv
        next_value = m * values_B_T[:, t] + (1 - m) * next_value
        adv_steps.append(adv_t * m)
    advantages = torch.stack(adv_steps[::-1], dim=1)
    returns = (advantages + values_B_T) * mask
    return advantages, returns


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Masked whitening: (x - mean) / sqrt(var + eps) over ``mask == 1`` entries, with the
    unbiased (Bessel-corrected) variance as in TRL / verl. With ``shift_mean=False`` the mean is
    added back (used for rewards). Any shape; masked entries are returned as 0 either way.
    """
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) ** 2) * m).sum() / n.clamp(min=1)
    var = var * n / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m
