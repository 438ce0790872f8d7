"""The pair-loss registry: SimPO (Meng et al. 2024) and ORPO (Hong et al. 2024) against numbers worked out
by hand (math / float64 here, not the code under test), gradient signs, the registry's data, and one
new loss added by registration alone."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import assert_close
from unialign import algos
from unialign.algos import pair_losses
from unialign.algos.pair_losses import PAIR_LOSSES, register_pair_loss
from unialign.algos.preference import DPO_LOSS_TYPES, REFERENCE_FREE_LOSSES, dpo_loss

F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def softplus(x: float) -> float:  # -log sigma(-x) = log(1 + e^x)
    return math.log1p(math.exp(x))


# ----------------------------------------------------------------------------- SimPO
def test_simpo_by_hand():
    # L = -log sigma(beta (w - l) - gamma) = log(1 + e^-(beta (w - l) - gamma)); beta 2, gamma 0.5:
    # w - l = 0.5 -> z = 0.5; w - l = -0.25 -> z = -1; w - l = 0 -> z = -0.5; w - l = 0.25 -> z = 0 (ln 2)
    w, l_ = t64([-0.5, -1.0, -2.0, -1.0]), t64([-1.0, -0.75, -2.0, -1.25])
    want = [softplus(-0.5), softplus(1.0), softplus(0.5), math.log(2)]
    assert_close(algos.simpo_loss(w, l_), want)  # defaults beta = 2.0, gamma = 0.5
    assert_close(algos.simpo_loss(w, l_, beta=2.0, gamma=0.5), want)
    # beta 1, gamma 0: plain Bradley-Terry on the average log-likelihoods
    assert_close(algos.simpo_loss(w, l_, beta=1.0, gamma=0.0), [softplus(-0.5), softplus(0.25), math.log(2),
                                                                softplus(-0.25)])


def test_simpo_gradient_signs_and_values():
    # dL/dw = -beta sigma(-z), dL/dl = +beta sigma(-z): descending raises the chosen, lowers the rejected
    w, l_ = t64([-0.5, -1.0]).requires_grad_(), t64([-1.0, -0.75]).requires_grad_()
    algos.simpo_loss(w, l_, beta=2.0, gamma=0.5).sum().backward()
    sig = [1 / (1 + math.exp(z)) for z in (0.5, -1.0)]  # sigma(-z)
    assert_close(w.grad, [-2.0 * s for s in sig])
    assert_close(l_.grad, [2.0 * s for s in sig])
    assert (w.grad < 0).all() and (l_.grad > 0).all()


# ----------------------------------------------------------------------------- ORPO
def test_orpo_odds_ratio_by_hand():
    # p_w = 0.75 (odds 3), p_l = 0.25 (odds 1/3): L = -0.1 log sigma(2 ln 3) = 0.1 ln(1 + 1/9) = 0.1 ln(10/9)
    # p_w = p_l = 0.5: 0.1 ln 2;  p_w = 0.2 (odds 1/4), p_l = 0.8 (odds 4): 0.1 ln(1 + 16) = 0.1 ln 17
    w = t64([math.log(0.75), math.log(0.5), math.log(0.2)])
    l_ = t64([math.log(0.25), math.log(0.5), math.log(0.8)])
    want = [0.1 * math.log(10 / 9), 0.1 * math.log(2), 0.1 * math.log(17)]
    assert_close(algos.orpo_odds_ratio_loss(w, l_), want)  # default beta = 0.1
    assert_close(algos.orpo_odds_ratio_loss(w, l_, beta=0.5), [5 * x for x in want])
    assert_close(pair_losses.log_odds(w), [math.log(3), 0.0, -math.log(4)])


def test_orpo_gradient_signs_and_values():
    # d/dx log odds(x) = 1 + e^x / (1 - e^x) = 1 / (1 - p);  dL/dw = -beta sigma(-d) / (1 - p_w), d = lo_w - lo_l
    w, l_ = t64([math.log(0.75)]).requires_grad_(), t64([math.log(0.25)]).requires_grad_()
    algos.orpo_odds_ratio_loss(w, l_, beta=0.1).sum().backward()
    s = 1 / (1 + 9.0)  # sigma(-2 ln 3) = 1 / (1 + e^(2 ln 3))
    assert_close(w.grad, [-0.1 * s / 0.25])
    assert_close(l_.grad, [0.1 * s / 0.75])


def test_orpo_is_stable_near_certainty():
    # float32 avg log-likelihood -1e-8: exp(x) rounds to 1 in float32, so a naive log(1 - exp(x)) is -inf;
    # float64 math (1 - e^x good to ~1e-8 relative there) gives log odds = x - log(1 - e^x) ~ 18.42
    x32 = torch.tensor([-1e-8], dtype=torch.float32)
    x = float(x32)
    assert torch.log(1 - torch.exp(x32)).isinf().all()
    assert_close(pair_losses.log_odds(x32), [x - math.log(1 - math.exp(x))])
    # exactly 0 (a side the model is certain of in float32): finite loss and gradient, no inf - inf
    w, l_ = torch.tensor([0.0, -0.1]).requires_grad_(), torch.tensor([-0.3, 0.0]).requires_grad_()
    losses = algos.orpo_odds_ratio_loss(w, l_)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(w.grad).all() and torch.isfinite(l_.grad).all()
    assert losses[0] < 1e-6 and losses[1] > 1.0  # certain of the chosen: ~0; of the rejected: large


def test_chosen_nll_by_hand():
    # -log pi(y_w) / |y_w|: -(-4) / 2 = 2, -(-3) / 3 = 1; length 0 is clamped to 1; None: already averaged
    assert_close(algos.chosen_nll_loss(t64([-4.0, -3.0, -1.5]), t64([2.0, 3.0, 0.0])), [2.0, 1.0, 1.5])
    assert_close(algos.chosen_nll_loss(t64([-4.0, -3.0])), [4.0, 3.0])


# ----------------------------------------------------------------------------- registry
def test_registry_entries_carry_their_data():
    data = {n: (e.needs_reference, e.length_normalize, e.nll_coef, e.params) for n, e in PAIR_LOSSES.items()}
    assert data["sigmoid"] == (True, False, 0.0, ("label_smoothing",))
    assert data["ipo"] == (True, True, 0.0, ())
    assert data["hinge"] == (True, False, 0.0, ())
    assert data["robust"] == (True, False, 0.0, ("label_smoothing",))
    assert data["rpo"] == (True, False, 1.0, ("label_smoothing",))
    assert data["simpo"] == (False, True, 0.0, ("gamma",))
    assert data["orpo"] == (False, True, 1.0, ())
    assert PAIR_LOSSES["simpo"].fn is algos.simpo_loss and PAIR_LOSSES["orpo"].fn is algos.orpo_odds_ratio_loss
    assert DPO_LOSS_TYPES == ("sigmoid", "ipo", "hinge", "robust") and REFERENCE_FREE_LOSSES == ("simpo", "orpo")


def test_dpo_loss_dispatches_reference_free_entries_and_checks_arguments():
    w, l_ = t64([-0.5, -1.0]), t64([-1.0, -0.75])
    losses, cr, rr = dpo_loss(w, l_, None, None, 2.0, "simpo", gamma=0.5)
    assert_close(losses, [softplus(-0.5), softplus(1.0)])
    assert_close(cr, [-1.0, -2.0])  # beta * avg log pi, no reference
    assert_close(rr, [-2.0, -1.5])
    losses, _, _ = dpo_loss(w, l_, None, None, 0.1, "orpo")
    assert_close(losses, algos.orpo_odds_ratio_loss(w, l_, 0.1))
    # rpo is sigmoid's function (its NLL weight is data): same pair losses
    assert_close(dpo_loss(w, l_, w * 0, l_ * 0, 0.3, "rpo")[0], dpo_loss(w, l_, w * 0, l_ * 0, 0.3)[0])
    with pytest.raises(ValueError, match="reference-free"):
        dpo_loss(w, l_, w, l_, 2.0, "simpo")
    with pytest.raises(ValueError, match="needs both"):
        dpo_loss(w, l_, None, None, 0.1, "sigmoid")
    with pytest.raises(ValueError, match="takes no parameter 'gamma'"):
        dpo_loss(w, l_, w, l_, 0.1, "sigmoid", gamma=0.5)
    with pytest.raises(ValueError, match="label_smoothing applies to"):
        dpo_loss(w, l_, None, None, 2.0, "simpo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="already registered"):
        register_pair_loss("simpo", needs_reference=False, length_normalize=True)(algos.simpo_loss)


def test_a_new_pair_loss_is_one_function_and_one_registration(monkeypatch):
    monkeypatch.setattr(pair_losses, "PAIR_LOSSES", dict(PAIR_LOSSES))  # registered for this test only

    @register_pair_loss("squared_margin", needs_reference=False, length_normalize=True)
    def squared_margin_loss(chosen_avg_logps, rejected_avg_logps, beta, margin: float = 1.0):
        """(margin - beta (w - l))^2, a toy loss."""
        return (margin - beta * (chosen_avg_logps - rejected_avg_logps)) ** 2

    losses, _, _ = dpo_loss(t64([-1.0]), t64([-2.0]), None, None, 0.5, "squared_margin", margin=2.0)
    assert_close(losses, [(2.0 - 0.5) ** 2])
    assert pair_losses.PAIR_LOSSES["squared_margin"].params == ("margin",)
    assert "squared_margin" not in PAIR_LOSSES
