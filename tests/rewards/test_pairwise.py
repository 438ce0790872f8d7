"""Pref-GRPO's pairwise rewards: win rates by hand, the ``win_rate`` estimator, and the ``pairwise`` reward with a
judge of two samples and with a score compared pairwise."""

from __future__ import annotations

import math

import pytest
import torch

from unialign.algos import AdvantageInputs
from unialign.algos.advantage_estimators import get_estimator
from unialign.algos.advantages import group_advantages, preferences_from_scores, win_rates
from unialign.registry import get_algorithm
from unialign.rewards import get_reward
from unialign.rewards.pairwise import PairwiseReward, group_indices


def test_win_rates_by_hand():
    # scores 0.3, 0.1, 0.3, 0.9: sample 0 beats 1, ties 2 (1/2), loses to 3 -> (1 + 0.5 + 0) / 3 = 0.5
    w = win_rates(preferences_from_scores(torch.tensor([[0.3, 0.1, 0.3, 0.9]], dtype=torch.float64)))
    assert w.tolist() == [[0.5, 0.0, 0.5, 1.0]]
    # a NaN score: left out of everyone's comparisons, and itself NaN
    w = win_rates(preferences_from_scores(torch.tensor([[1.0, float("nan"), 0.0]], dtype=torch.float64)))
    assert w[0, 0] == 1.0 and math.isnan(w[0, 1]) and w[0, 2] == 0.0
    # soft preferences: w_i = mean_j pref[i, j] over j != i (the diagonal ignored)
    pref = torch.tensor([[[9.0, 0.8, 0.6], [0.2, 9.0, 0.5], [0.4, 0.5, 9.0]]], dtype=torch.float64)
    assert torch.allclose(win_rates(pref), torch.tensor([[0.7, 0.35, 0.45]], dtype=torch.float64))


def test_win_rate_estimator_removes_the_illusory_advantage():
    """Two groups with the same order, one with gaps of 1e-3: plain GRPO gives both the same advantages
    (normalisation blows the tiny gaps up); so does the win rate, but from the order alone -- and a group whose
    scores differ by 1e-3 except one outlier no longer gives the outlier's neighbours near-equal full units."""
    r = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.500, 0.501, 0.502, 5.0], dtype=torch.float64)
    inputs = AdvantageInputs(rewards_B=r, prompts=["a"] * 4 + ["b"] * 4, group_size=4, rows=slice(0, 8),
                             mask_B_T=torch.ones(8, 1))
    spec = get_algorithm("grpo", scale_rewards="group")
    got = get_estimator("win_rate").fn(inputs, spec).advantages_B_T[:, 0].double()
    w = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3], dtype=torch.float64) / 3      # win rates: the order only
    assert torch.allclose(got, group_advantages(w, 4, "group").to(got.dtype), atol=1e-6)
    assert torch.allclose(got[:4], got[4:], atol=1e-6)
    plain = group_advantages(r, 4, "group")
    assert plain[5] - plain[4] < 0.01 < got[5] - got[4]   # GRPO: 1e-3 gap ~ nothing beside the outlier; here a step


def test_pref_grpo_preset():
    spec = get_algorithm("pref_grpo")
    assert spec.advantage == "win_rate" and spec.epsilon == get_algorithm("flow_grpo").epsilon


def prefer_longer(prompts, a, b):
    """A judge of two samples: the longer string wins, equal lengths 0.5."""
    return [1.0 if len(x) > len(y) else 0.5 if len(x) == len(y) else 0.0 for x, y in zip(a, b)]


def test_pairwise_reward_with_a_judge_and_with_a_score():
    prompts = ["p", "p", "p", "q", "q"]
    completions = ["aaa", "a", "aa", "b", "bbbb"]
    assert group_indices(prompts) == [[0, 1, 2], [3, 4]]
    judged = get_reward("pairwise", judge=prefer_longer)
    assert judged(prompts, completions) == [1.0, 0.0, 0.5, 0.0, 1.0]
    assert get_reward("pairwise", judge="tests.rewards.test_pairwise:prefer_longer")(prompts, completions) == \
        [1.0, 0.0, 0.5, 0.0, 1.0]
    # a score compared pairwise: ties count one half
    scored = PairwiseReward(score="tests.rewards.test_pairwise:length_score")
    assert scored(prompts, ["x", "x", "xx", "y", "y"]) == [0.25, 0.25, 1.0, 0.5, 0.5]


def length_score(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def test_symmetric_judging_averages_a_position_bias():
    calls = []

    def biased(prompts, a, b):  # prefers whatever comes first by 0.2 on top of the truth
        calls.append(len(a))
        return [min(1.0, 0.2 + (1.0 if len(x) > len(y) else 0.0)) for x, y in zip(a, b)]

    one = PairwiseReward(judge=biased)(["p", "p"], ["aa", "a"])
    both = PairwiseReward(judge=biased, symmetric=True)(["p", "p"], ["aa", "a"])
    assert one == [1.0, 0.0] and both == pytest.approx([0.9, 0.1]) and calls == [1, 1, 1]


def test_pairwise_errors():
    with pytest.raises(ValueError, match="exactly one of judge"):
        PairwiseReward()
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        PairwiseReward(judge=lambda p, a, b: [2.0] * len(a))(["p", "p"], ["a", "b"])
    with pytest.raises(ValueError, match="returned 0 values for 1 pairs"):
        PairwiseReward(judge=lambda p, a, b: [])(["p", "p"], ["a", "b"])
