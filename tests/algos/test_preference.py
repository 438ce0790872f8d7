"""Reference-formula tests for unialign.algos.preference: DPO (Rafailov et al. 2023), cDPO, IPO, SLiC hinge,
robust DPO (Chowdhury et al. 2024) as TRL writes them, Diffusion-DPO (Wallace et al. 2023), Bradley-Terry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.helpers import assert_close
from unialign.algos.preference import bradley_terry_loss, dpo_loss

F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def np_logsigmoid(x):
    return -np.logaddexp(0.0, -x)


# four pairs: policy / reference log-likelihoods of chosen (w) and rejected (l)
PW, PL = np.array([-10.0, -12.0, -5.0, -7.5]), np.array([-11.0, -11.0, -5.0, -9.0])
RW, RL = np.array([-10.5, -12.0, -6.0, -7.0]), np.array([-10.5, -10.0, -5.5, -8.0])
H = (PW - PL) - (RW - RL)  # = [1 - 0, -1 + 2, 0 + 0.5, 1.5 - 1] = [1, 1, 0.5, 0.5]


def call(loss_type, beta, ls=0.0):
    return dpo_loss(t64(PW), t64(PL), t64(RW), t64(RL), beta=beta, loss_type=loss_type, label_smoothing=ls)


def test_logits_by_hand():
    assert_close(t64(H), [1.0, 1.0, 0.5, 0.5])


def test_sigmoid_by_hand():
    # beta = 0.1: -log sigma(0.1) = log(1 + e^-0.1) for the first two pairs, log(1 + e^-0.05) for the others
    losses, cr, rr = call("sigmoid", 0.1)
    a, b = math.log1p(math.exp(-0.1)), math.log1p(math.exp(-0.05))
    assert_close(losses, [a, a, b, b])
    # implicit rewards beta (log pi - log pi_ref): chosen 0.1*[0.5, 0, 1, -0.5], rejected 0.1*[-0.5, -1, 0.5, -1]
    assert_close(cr, [0.05, 0.0, 0.1, -0.05])
    assert_close(rr, [-0.05, -0.1, 0.05, -0.1])


def test_cdpo_matches_numpy():
    # cDPO / TRL sigmoid with label smoothing eps: -(1-eps) log sigma(beta h) - eps log sigma(-beta h)
    beta, eps = 0.5, 0.1
    losses, _, _ = call("sigmoid", beta, eps)
    assert_close(losses, -(1 - eps) * np_logsigmoid(beta * H) - eps * np_logsigmoid(-beta * H))


def test_ipo_by_hand():
    # beta = 0.1: 1/(2 beta) = 5 -> (1 - 5)^2 = 16, (0.5 - 5)^2 = 20.25
    losses, _, _ = call("ipo", 0.1)
    assert_close(losses, [16.0, 16.0, 20.25, 20.25])


def test_hinge_by_hand():
    # beta = 1.5: max(0, 1 - 1.5) = 0 for h = 1; max(0, 1 - 0.75) = 0.25 for h = 0.5
    losses, _, _ = call("hinge", 1.5)
    assert_close(losses, [0.0, 0.0, 0.25, 0.25])


def test_robust_matches_numpy():
    # robust DPO as TRL: [-(1-eps) log sigma(beta h) + eps log sigma(-beta h)] / (1 - 2 eps)
    beta, eps = 0.2, 0.2
    losses, _, _ = call("robust", beta, eps)
    expected = (-(1 - eps) * np_logsigmoid(beta * H) + eps * np_logsigmoid(-beta * H)) / (1 - 2 * eps)
    assert_close(losses, expected)


def test_sigmoid_equals_robust_without_smoothing():
    a, _, _ = call("sigmoid", 0.3, 0.0)
    b, _, _ = call("robust", 0.3, 0.0)
    assert_close(a, b)


def test_sigmoid_gradient():
    # d/d log pi(y_w) of -log sigma(beta h) = -beta sigma(-beta h); d/d log pi(y_l) = +beta sigma(-beta h)
    beta = 0.7
    pw, pl = t64(PW).requires_grad_(), t64(PL).requires_grad_()
    losses, cr, rr = dpo_loss(pw, pl, t64(RW), t64(RL), beta=beta)
    losses.sum().backward()
    sig = 1 / (1 + np.exp(beta * H))
    assert_close(pw.grad, -beta * sig)
    assert_close(pl.grad, beta * sig)
    assert not cr.requires_grad and not rr.requires_grad


@pytest.mark.parametrize("kw", [{"loss_type": "kto"}, {"label_smoothing": 0.5}, {"label_smoothing": -0.1}])
def test_bad_arguments(kw):
    z = torch.zeros(2)
    with pytest.raises(ValueError):
        dpo_loss(z, z, z, z, beta=0.1, **kw)


# ----------------------------------------------------------------------------- Diffusion-DPO anchor
def test_diffusion_dpo_reference_loss():
    """With logp = -1/2 * mse (per-sample mean squared noise error) and beta = 5000, dpo_loss equals the
    Diffusion-DPO reference (diffusers train_diffusion_dpo.py):
        inside = -0.5 * beta * ((mse_w - mse_l) - (ref_w - ref_l));  loss = -log sigma(inside)."""
    rng = np.random.default_rng(0)
    ref_w, ref_l = rng.uniform(0.05, 0.2, size=6), rng.uniform(0.05, 0.2, size=6)
    mse_w, mse_l = ref_w + rng.normal(0, 2e-4, size=6), ref_l + rng.normal(0, 2e-4, size=6)
    beta = 5000.0
    losses, _, _ = dpo_loss(t64(-0.5 * mse_w), t64(-0.5 * mse_l), t64(-0.5 * ref_w), t64(-0.5 * ref_l), beta=beta)
    inside = -0.5 * beta * ((mse_w - mse_l) - (ref_w - ref_l))
    assert_close(losses, -np_logsigmoid(inside))


def test_diffusion_dpo_at_init_is_ln2_with_slope_beta_over_4():
    # at initialisation policy == reference: Delta = (mse_w - mse_l) - (ref_w - ref_l) = 0, loss = -log(1/2) = ln 2;
    # d loss / d Delta = sigma(0) * 0.5 * beta = beta / 4 = 1250, and d Delta / d mse_w = 1, d Delta / d mse_l = -1
    beta = 5000.0
    ref_w, ref_l = t64([0.11, 0.3]), t64([0.07, 0.25])
    mse_w, mse_l = ref_w.clone().requires_grad_(), ref_l.clone().requires_grad_()
    losses, _, _ = dpo_loss(-0.5 * mse_w, -0.5 * mse_l, -0.5 * ref_w, -0.5 * ref_l, beta=beta)
    losses.sum().backward()
    assert_close(losses, [math.log(2)] * 2)
    assert_close(mse_w.grad, [1250.0, 1250.0])
    assert_close(mse_l.grad, [-1250.0, -1250.0])


# ----------------------------------------------------------------------------- Bradley-Terry
def test_bradley_terry_by_hand():
    # r_w - r_l = 1: -log sigma(1) = log(1 + e^-1); = -2: log(1 + e^2)
    lw, ll = t64([1.0, 0.5]), t64([0.0, 2.5])
    assert_close(bradley_terry_loss(lw, ll), [math.log1p(math.exp(-1)), math.log1p(math.exp(2))])
    # margin 0.5 on the first pair: -log sigma(1 - 0.5) = log(1 + e^-0.5); margin 0 on the second
    assert_close(bradley_terry_loss(lw, ll, margin=t64([0.5, 0.0])),
                 [math.log1p(math.exp(-0.5)), math.log1p(math.exp(2))])
    # centring 0.01: + 0.01 * (r_w + r_l)^2 = 0.01 * 1 and 0.01 * 9
    assert_close(bradley_terry_loss(lw, ll, center_coef=0.01),
                 [math.log1p(math.exp(-1)) + 0.01, math.log1p(math.exp(2)) + 0.09])


def test_bradley_terry_batch_mean_is_trl_loss():
    # TRL RewardTrainer: -logsigmoid(r_w - r_l - margin).mean() + c * mean((r_w + r_l)^2)
    rng = np.random.default_rng(1)
    rw, rl, m = rng.normal(size=8), rng.normal(size=8), rng.uniform(0, 1, size=8)
    c = 0.05
    out = bradley_terry_loss(t64(rw), t64(rl), margin=t64(m), center_coef=c).mean()
    assert_close(out, np.mean(-np_logsigmoid(rw - rl - m)) + c * np.mean((rw + rl) ** 2))


def test_bradley_terry_gradient():
    # d/dr_w of -log sigma(r_w - r_l) = -sigma(r_l - r_w); at r_w = r_l: -1/2 (and +1/2 for r_l)
    rw, rl = t64([0.3]).requires_grad_(), t64([0.3]).requires_grad_()
    bradley_terry_loss(rw, rl).sum().backward()
    assert_close(rw.grad, [-0.5])
    assert_close(rl.grad, [0.5])


def test_label_smoothing_is_rejected_where_it_has_no_meaning():
    z = torch.zeros(2)
    for loss_type in ("ipo", "hinge"):
        with pytest.raises(ValueError, match="label_smoothing"):
            dpo_loss(z, z, z, z, beta=0.1, loss_type=loss_type, label_smoothing=0.1)
