"""SPG's and wd1's objectives (registered policy losses) and wd1's weights, against hand-computed values."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from unialign.algos import get_estimator, get_policy_loss
from unialign.algos.advantage_estimators import AdvantageInputs


def test_spg_uses_the_elbo_for_positive_and_the_mixed_bound_for_negative_advantages():
    elbo = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    eubo = torch.tensor([[-0.5, -1.0], [-2.0, -1.0]])
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = get_policy_loss("spg")(elbo, elbo.detach(), adv, mask, SimpleNamespace(spg_mix_weight=0.5),
                                           eubo=eubo)
    # row 0: -2 * elbo; row 1: +1 * (0.5 * eubo + 0.5 * elbo), the masked step 0
    want = torch.tensor([[2.0, 4.0], [0.5 * -2.0 + 0.5 * -3.0, 0.0]])
    torch.testing.assert_close(loss.detach(), want)
    assert float(metrics["spg_negative_frac"]) == pytest.approx(1 / 3)
    loss.sum().backward()
    torch.testing.assert_close(elbo.grad, torch.tensor([[-2.0, -2.0], [0.5, 0.0]]))  # the EUBO carries its own grad


def test_wd1_weights_are_the_softmax_difference_of_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    out = get_estimator("wd1").fn(AdvantageInputs(rewards, ["a"] * 4 + ["b"] * 4, 4, slice(0, 8),
                                                  torch.ones(8, 3)), SimpleNamespace(scale_rewards="group"))
    # group 1: mean 0.5, std (unbiased) 0.5774: A = +-0.866; softmax(A) - softmax(-A), times G = 4
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # group_advantages divides by std + 1e-4
    e_pos, e_neg = math.exp(a), math.exp(-a)
    w_hi = 4 * (e_pos / (2 * e_pos + 2 * e_neg) - e_neg / (2 * e_pos + 2 * e_neg))
    torch.testing.assert_close(out.advantages_B_T[:4, 0], torch.tensor([w_hi, -w_hi, -w_hi, w_hi],
                                                                          dtype=torch.float64))
    assert float(out.advantages_B_T[4:, 0].sum()) == pytest.approx(0.0, abs=1e-12)  # antisymmetric within a group
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    loss, _ = get_policy_loss("wd1")(logp, logp.detach(), torch.tensor([0.5]), torch.ones(1, 3), None)
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.5, 1.0, 1.5]]))  # -w * log pi, no ratio
