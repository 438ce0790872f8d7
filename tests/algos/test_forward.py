"""Forward-process RL math against independent float64 restatements: AWM's weighted matching log-prob
(scxue/advantage_weighted_matching ``compute_log_prob_awm``), DiffusionNFT's weight and loss
(NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` L910-960), and their reductions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unialign.algos import clipped_policy_loss
from unialign.algos.forward import matching_logprob, nft_loss, nft_loss_terms, nft_weight


def _data(seed=0, b=4, shape=(3, 4, 4)):
    g = np.random.default_rng(seed)
    return (g.normal(size=(b, *shape)), g.normal(size=(b, *shape)), g.uniform(0.05, 0.95, size=b))


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "ghuber"])
def test_matching_logprob_against_awm(weighting):
    pred, target, t = _data()
    m = ((pred - target) ** 2).reshape(4, -1).mean(1)
    p = 0.25
    want = {"uniform": -m, "t": -m * t, "t2": -m * t**2,
            "ghuber": -((m + 1e-10) ** p - 1e-10**p) * t / p}[weighting]
    got = matching_logprob(torch.tensor(pred, dtype=torch.float32), torch.tensor(target, dtype=torch.float32),
                           torch.tensor(t), weighting, p)
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-6)
    with pytest.raises(ValueError, match="weighting"):
        matching_logprob(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), "huber")


def test_nft_weight():
    a = torch.tensor([-9.0, -5.0, -1.0, 0.0, 2.5, 5.0, 7.0])
    want = np.clip(a.numpy(), -5, 5) / 5 / 2 + 0.5
    np.testing.assert_allclose(nft_weight(a, 5.0).numpy(), want)
    assert nft_weight(a, 5.0).min() == 0.0 and nft_weight(a, 5.0).max() == 1.0


def _nft_reference(v, v_old, x0, xt, sigma, r, beta):
    """train_nft_sd3.py L934-959 in numpy float64 (weights detached by construction)."""
    s = sigma.reshape(-1, 1, 1, 1)
    pos_v = beta * v + (1 - beta) * v_old
    neg_v = (1.0 + beta) * v_old - beta * v
    out = []
    for pred in (pos_v, neg_v):
        x0_pred = xt - s * pred
        w = np.clip(np.abs(x0_pred - x0).reshape(len(x0), -1).mean(1), 1e-5, None).reshape(-1, 1, 1, 1)
        out.append(((x0_pred - x0) ** 2 / w).reshape(len(x0), -1).mean(1))
    return r * out[0] / beta + (1.0 - r) * out[1] / beta


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_against_the_reference(beta):
    g = np.random.default_rng(1)
    v, v_old, x0, eps = (g.normal(size=(5, 2, 3, 3)) for _ in range(4))
    sigma = g.uniform(0.1, 0.9, size=5)
    xt = (1 - sigma.reshape(-1, 1, 1, 1)) * x0 + sigma.reshape(-1, 1, 1, 1) * eps
    r = g.uniform(0, 1, size=5)
    want = _nft_reference(v, v_old, x0, xt, sigma, r, beta)
    vt = torch.tensor(v, requires_grad=True)
    got = nft_loss(vt, torch.tensor(v_old), torch.tensor(x0), torch.tensor(xt), torch.tensor(sigma), torch.tensor(r),
                   beta)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-6)
    got.sum().backward()
    # the gradient with the adaptive weights held constant, by hand: d/dv of sum_b [r e+ + (1 - r) e-] / beta
    s = sigma.reshape(-1, 1, 1, 1)
    grad = np.zeros_like(v)
    d = np.prod(v.shape[1:])
    for coef, sign, weight in ((beta, 1, r), (-beta, -1, 1 - r)):
        pred = (beta * v + (1 - beta) * v_old) if sign > 0 else ((1 + beta) * v_old - beta * v)
        err = xt - s * pred - x0
        w = np.clip(np.abs(err).reshape(5, -1).mean(1), 1e-5, None).reshape(-1, 1, 1, 1)
        grad += weight.reshape(-1, 1, 1, 1) / beta * 2 * err * (-s * coef) / (w * d)
    np.testing.assert_allclose(vt.grad.numpy(), grad, rtol=1e-6, atol=1e-12)


def test_nft_reduces_to_the_weighted_flow_matching_loss():
    """r = 1, beta = 1: v+ = v, the loss is mean_D (x_t - sigma v - x0)^2 / w = sigma^2 mean_D (v - (eps - x0))^2 / w."""
    g = np.random.default_rng(2)
    v, v_old, x0, eps = (g.normal(size=(3, 2, 2, 2)) for _ in range(4))
    sigma = g.uniform(0.2, 0.8, size=3)
    s = sigma.reshape(-1, 1, 1, 1)
    xt = (1 - s) * x0 + s * eps
    got = nft_loss(torch.tensor(v), torch.tensor(v_old), torch.tensor(x0), torch.tensor(xt), torch.tensor(sigma),
                   torch.ones(3, dtype=torch.float64), 1.0).numpy()
    w = (s * np.abs(v - (eps - x0))).reshape(3, -1).mean(1)
    want = (sigma**2) * ((v - (eps - x0)) ** 2).reshape(3, -1).mean(1) / w
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_nft_loss_terms_is_the_clean_image_form():
    g = np.random.default_rng(3)
    old_err, delta = torch.tensor(g.normal(size=(4, 6))), torch.tensor(g.normal(size=(4, 6)))
    r = torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=torch.float64)
    got = nft_loss_terms(old_err, delta, r, 0.5).double()
    e = [((old_err + s * 0.5 * delta) ** 2).mean(1) / (old_err + s * 0.5 * delta).abs().mean(1) for s in (1, -1)]
    torch.testing.assert_close(got, (r * e[0] + (1 - r) * e[1]) / 0.5, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="beta"):
        nft_loss_terms(old_err, delta, r, 0.0)


def test_awm_at_ratio_one_with_unit_advantages_is_the_plain_matching_gradient():
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(6, 8, generator=g, requires_grad=True)
    target = torch.randn(6, 8, generator=g)
    logp = matching_logprob(pred, target, torch.rand(6, generator=g), "uniform").view(3, 2)
    loss, _ = clipped_policy_loss(logp, logp.detach(), torch.ones(3), torch.ones(3, 2), 1.0)
    loss.sum().backward()
    awm = pred.grad.clone()
    pred.grad = None
    ((pred - target) ** 2).mean(1).sum().backward()
    torch.testing.assert_close(awm, pred.grad, rtol=1e-5, atol=1e-7)
