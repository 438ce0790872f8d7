"""Reference-formula tests for unialign.algos.kl (Schulman, "Approximating KL divergence", 2020)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_close
from unialign.algos.kl import check_kl_estimator, gaussian_kl, kl_estimate

F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def test_k1_k2_k3_by_hand():
    # logp = -1, ref = -2: log pi/pi_ref = 1, r = pi_ref/pi = e^-1
    # k1 = 1; k2 = 1/2 * 1^2 = 0.5; k3 = (e^-1 - 1) - log(e^-1) = e^-1 - 1 + 1 = e^-1
    logp, ref = t64([-1.0, -2.0, -0.5]), t64([-2.0, -1.0, -0.5])
    # second element: log ratio -1, r = e: k1 = -1, k2 = 0.5, k3 = e - 1 - 1 = e - 2
    # third: equal -> all 0
    assert_close(kl_estimate(logp, ref, "k1"), [1.0, -1.0, 0.0])
    assert_close(kl_estimate(logp, ref, "k2"), [0.5, 0.5, 0.0])
    assert_close(kl_estimate(logp, ref, "k3"), [math.exp(-1), math.e - 2, 0.0])
    assert_close(kl_estimate(logp, ref), [math.exp(-1), math.e - 2, 0.0])  # default k3


def test_estimators_match_numpy():
    rng = np.random.default_rng(0)
    lp, rp = rng.normal(-3, 1, size=(4, 9)), rng.normal(-3, 1, size=(4, 9))
    r = np.exp(rp - lp)
    assert_close(kl_estimate(t64(lp), t64(rp), "k1"), -np.log(r))
    assert_close(kl_estimate(t64(lp), t64(rp), "k2"), 0.5 * np.log(r) ** 2)
    assert_close(kl_estimate(t64(lp), t64(rp), "k3"), (r - 1) - np.log(r))


@pytest.mark.parametrize("alias,name", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_aliases(alias, name):
    lp, rp = t64([-1.0, -0.3]), t64([-0.2, -2.0])
    assert torch.equal(kl_estimate(lp, rp, alias), kl_estimate(lp, rp, name))


def test_unknown_estimator_raises():
    with pytest.raises(ValueError):
        kl_estimate(t64([0.0]), t64([0.0]), "k4")


def test_clamp():
    # log ratio 30 clamped to 20: k1 = 20, k3 = e^-20 - 1 + 20; log ratio -30 -> -20: k3 = e^20 - 1 - 20
    lp, rp = t64([30.0, -30.0, 0.5]), t64([0.0, 0.0, 0.0])
    assert_close(kl_estimate(lp, rp, "k1", clamp=20.0), [20.0, -20.0, 0.5])
    assert_close(kl_estimate(lp, rp, "k3", clamp=20.0),
                 [math.exp(-20) + 19, math.exp(20) - 21, math.exp(-0.5) - 1 + 0.5])


def test_gradients():
    # d k1/d logp = 1; d k2/d logp = log ratio; d k3/d logp = 1 - r = 1 - exp(ref - logp)
    lp0, rp = np.array([-1.0, -2.0, -0.7]), np.array([-2.0, -1.0, -0.7])
    for name, expected in [("k1", np.ones(3)), ("k2", lp0 - rp), ("k3", 1 - np.exp(rp - lp0))]:
        lp = t64(lp0).requires_grad_()
        kl_estimate(lp, t64(rp), name).sum().backward()
        assert_close(lp.grad, expected, msg=name)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-15, 15), st.floats(-15, 15)), min_size=1, max_size=16))
def test_k3_nonnegative_and_k2_nonnegative(pairs):
    lp, rp = t64([a for a, _ in pairs]), t64([b for _, b in pairs])
    assert (kl_estimate(lp, rp, "k3") >= 0).all()
    assert (kl_estimate(lp, rp, "k2") >= 0).all()


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_monte_carlo_unbiased(name):
    """Samples x ~ p; the sample mean of k1 / k3 estimates KL(p || q) = sum p log(p/q) without bias.
    Tolerance: 5 standard errors of the sample mean (fixed seed, so deterministic)."""
    p = np.array([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])
    q = np.array([0.3, 0.25, 0.2, 0.1, 0.1, 0.05])
    exact = float(np.sum(p * np.log(p / q)))
    g = torch.Generator().manual_seed(1234)
    n = 200_000
    x = torch.multinomial(torch.tensor(p), n, replacement=True, generator=g)
    logp = torch.log(torch.tensor(p, dtype=F64))[x]
    logq = torch.log(torch.tensor(q, dtype=F64))[x]
    est = kl_estimate(logp, logq, name)
    mean, se = est.mean().item(), est.std().item() / math.sqrt(n)
    assert abs(mean - exact) < 5 * se, (name, mean, exact, se)
    assert se < 0.01 * exact  # the check is sharp: 5 sigma is well under the KL itself


def test_gaussian_kl_by_hand_and_against_torch_distributions():
    # two elements per sample, std 2: ((1 - 0)^2 + (2 - 0)^2) / 2 / (2 * 4) = 5 / 16
    mean, ref = t64([[1.0, 2.0], [0.5, 0.5]]), t64([[0.0, 0.0], [0.5, -0.5]])
    assert_close(gaussian_kl(mean, ref, 2.0), [5 / 16, 0.5 * 1.0 / 8])
    rng = np.random.default_rng(0)
    mu, mu_ref = t64(rng.normal(size=(3, 4, 2, 2))), t64(rng.normal(size=(3, 4, 2, 2)))
    std = t64(rng.uniform(0.1, 1.0, size=(3, 1, 1, 1)))
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(mu, std.expand_as(mu)), torch.distributions.Normal(mu_ref, std.expand_as(mu))
    ).mean(dim=(1, 2, 3))
    assert_close(gaussian_kl(mu, mu_ref, std), expected)
    assert_close(gaussian_kl(mu, mu, std), [0.0, 0.0, 0.0])


def test_unknown_estimator_is_named():
    check_kl_estimator("gaussian")
    check_kl_estimator("low_var_kl")
    with pytest.raises(ValueError, match="kl_estimator: unknown 'k4'"):
        check_kl_estimator("k4")
