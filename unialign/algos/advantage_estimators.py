"""Advantage estimators as registered functions (verl's ``register_adv_est`` pattern).

An estimator is ``fn(inputs: AdvantageInputs, spec) -> AdvantageOutput``; ``spec`` is any object with the
``AlgoSpec`` fields it reads (``unialign.registry``). The online trainer builds the inputs, looks the
estimator up by ``spec.advantage`` and never branches on its name. Adding one = one function here with
``@register_advantage(...)``, one preset in ``unialign.registry`` and its test.

Each entry carries data the trainer acts on before training starts:
  * ``needs_critic``: the policy must implement the critic protocol (``log_prob_and_values``: PPO's GAE);
  * ``needs_step_rewards``: the estimator reads per-step rewards (the sequence score at the last step,
    minus beta * KL_t on every step when the preset puts the KL in the reward: ``kl_shaped_rewards``);
  * ``uses_groups``: the estimator's baseline is the group of a prompt's G samples (needs G >= 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from unialign.algos.advantages import (
    PerPromptStatTracker,
    gae,
    group_advantages,
    preferences_from_scores,
    rloo_advantages,
    whiten,
    win_rates,
)
from unialign.algos.named import add_new, lookup

Tensor = torch.Tensor


@dataclass
class AdvantageInputs:
    """What an estimator may read. ``rewards_B`` and ``prompts`` cover every process's samples (global,
    float64, NaN for unscored samples); the [B, T] tensors are this process's rows, ``rows`` their
    place in the global batch. ``all_sum`` sums a tensor over processes (identity on one process)."""

    rewards_B: Tensor
    prompts: list[str]
    group_size: int
    rows: slice
    mask_B_T: Tensor
    step_rewards_B_T: Tensor | None = None
    values_B_T: Tensor | None = None
    stat_tracker: PerPromptStatTracker | None = None
    all_sum: Callable[[Tensor], Tensor] = lambda t: t


@dataclass
class AdvantageOutput:
    """``advantages_B_T`` for this process's rows (0 at masked steps is not required: the loss masks),
    ``returns_B_T`` the critic's targets (estimators with a critic), ``stats`` numbers to log."""

    advantages_B_T: Tensor
    returns_B_T: Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimator:
    fn: Callable[[AdvantageInputs, Any], AdvantageOutput]
    needs_critic: bool = False
    needs_step_rewards: bool = False
    uses_groups: bool = False


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage(name: str, needs_critic: bool = False, needs_step_rewards: bool = False,
                       uses_groups: bool = False):
    """Decorator: ``@register_advantage("rloo", uses_groups=True)`` over ``fn(inputs, spec) -> AdvantageOutput``."""
    def wrap(fn):
        add_new(ADVANTAGE_ESTIMATORS, name, Estimator(fn, needs_critic, needs_step_rewards, uses_groups),
                "advantage estimator")
        return fn
    return wrap


def get_estimator(name: str) -> Estimator:
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def _per_sequence(adv_B: Tensor, inputs: AdvantageInputs) -> AdvantageOutput:
    """A global per-sequence advantage [B] -> this process's rows, broadcast over steps [B, T]."""
    adv = adv_B[inputs.rows]
    return AdvantageOutput(adv.unsqueeze(-1).expand(-1, inputs.mask_B_T.shape[1]).contiguous())


@register_advantage("group", uses_groups=True)
def _group(inputs: AdvantageInputs, spec) -> AdvantageOutput:
    """GRPO: (r - group mean) / (group or batch std), ``spec.scale_rewards``."""
    return _per_sequence(group_advantages(inputs.rewards_B, inputs.group_size, spec.scale_rewards), inputs)


@register_advantage("win_rate", uses_groups=True)
def _win_rate(inputs: AdvantageInputs, spec) -> AdvantageOutput:
    """Pref-GRPO (arXiv 2508.20751): each reward replaced by its win rate against the rest of its group (the
    reward compared pairwise), then GRPO's group normalisation (``spec.scale_rewards``). A pairwise judge of two
    images gives the win rates as its reward instead (``unialign.rewards.pairwise``) with ``advantage=group``."""
    r_P_G = inputs.rewards_B.reshape(-1, inputs.group_size)
    w = win_rates(preferences_from_scores(r_P_G)).reshape(-1)
    return _per_sequence(group_advantages(w, inputs.group_size, spec.scale_rewards), inputs)


@register_advantage("rloo", uses_groups=True)
def _rloo(inputs: AdvantageInputs, spec) -> AdvantageOutput:
    """RLOO: r minus the mean of the group's other rewards."""
    return _per_sequence(rloo_advantages(inputs.rewards_B, inputs.group_size), inputs)


@register_advantage("per_prompt")
def _per_prompt(inputs: AdvantageInputs, spec) -> AdvantageOutput:
    """DDPO: normalised by each prompt's running reward statistics (the trainer's tracker)."""
    return _per_sequence(inputs.stat_tracker.update(inputs.prompts, inputs.rewards_B), inputs)


@register_advantage("reward")
def _raw_reward(inputs: AdvantageInputs, spec) -> AdvantageOutput:
    """REINFORCE without a baseline: the sequence reward itself (unscored samples: 0)."""
    return _per_sequence(torch.nan_to_num(inputs.rewards_B, nan=0.0, posinf=0.0, neginf=0.0), inputs)


@register_advantage("gae", needs_critic=True, needs_step_rewards=True)
def _gae(inputs: AdvantageInputs, spec) -> AdvantageOutput:
    """PPO: GAE(gamma, lambda) on the critic's values and the (KL-shaped) step rewards; optional
    reward whitening (scale only) and advantage whitening, per process."""
    mask, values = inputs.mask_B_T.double(), inputs.values_B_T.double()
    step_rewards = inputs.step_rewards_B_T.double()
    if spec.whiten_rewards:  # TRL's whiten_rewards: scale only, the mean is kept
        step_rewards = whiten(step_rewards, mask, shift_mean=False)
    adv, returns = gae(step_rewards, values, mask, spec.gamma, spec.lam)
    if spec.whiten_advantages:
        adv = whiten(adv, mask)
    return AdvantageOutput(adv, returns, {
        "values_mean": float((values * mask).sum() / mask.sum().clamp(min=1))})


def discounted_returns(step_rewards_B_T: Tensor, mask_B_T: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over unmasked steps (masked steps pass the sum through and get 0).
    [B, T] -> [B, T], no gradient."""
    r, m = step_rewards_B_T.detach(), mask_B_T.to(step_rewards_B_T.dtype)
    running = torch.zeros_like(r[:, 0])
    out = []
    for t in reversed(range(r.shape[1])):
        running = m[:, t] * (r[:, t] + gamma * running) + (1 - m[:, t]) * running
        out.append(running * m[:, t])
    return torch.stack(out[::-1], dim=1)


def global_whiten(x_B_T: Tensor, mask_B_T: Tensor, all_sum: Callable[[Tensor], Tensor] = lambda t: t,
                  eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and unbiased variance of the unmasked entries of EVERY
    process (``all_sum`` adds the per-process sums). Equals ``whiten`` on one process. [B, T] -> [B, T],
    0 at masked steps."""
    m = mask_B_T.to(x_B_T.dtype)
    sums = all_sum(torch.stack([(x_B_T * m).sum(), (x_B_T * x_B_T * m).sum(), m.sum()]))
    n = sums[2].clamp(min=1)
    mean = sums[0] / n
    var = (sums[1] - n * mean * mean).clamp(min=0) / (n - 1).clamp(min=1)
    return (x_B_T - mean) * torch.rsqrt(var + eps) * m


@register_advantage("reinforce_pp", needs_step_rewards=True)
def _reinforce_pp(inputs: AdvantageInputs, spec) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs", eqs. 5-7;
    OpenRLHF): the KL-shaped token rewards' returns with gamma = ``spec.gamma`` (1 in the preset),
    A_t = whiten(G_t) over the unmasked tokens of the global batch. No critic, no groups."""
    mask = inputs.mask_B_T.double()
    returns = discounted_returns(inputs.step_rewards_B_T.double(), mask, spec.gamma)
    return AdvantageOutput(global_whiten(returns, mask, inputs.all_sum))
