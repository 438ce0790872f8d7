"""DGPO's group-level loss, GRPO-Guard's RatioNorm and step weight, Flow-DPPO's trust-region mask: each against an
independent float64 restatement of its paper's formula written here element by element (no vectorised code shared
with unialign.algos), values and gradients, and their reductions; and ``unialign.algos.__all__`` against the public
functions and classes of its modules."""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil

import pytest
import torch

import unialign.algos as algos


def test_algos_exports_every_public_function_of_its_modules():
    internal = {"Estimator", "Aggregation", "LogProbEstimator",  # registry entry types, reached through get_*
                "add_new", "lookup"}  # the registries' own two rules (algos.named)
    public = set()
    for info in pkgutil.iter_modules(algos.__path__):
        module = importlib.import_module(f"unialign.algos.{info.name}")
        public |= {n for n, o in vars(module).items() if not n.startswith("_") and getattr(o, "__module__", None)
                   == module.__name__ and (inspect.isfunction(o) or inspect.isclass(o))}
    assert public - internal <= set(algos.__all__), sorted(public - internal - set(algos.__all__))
    assert all(hasattr(algos, n) for n in algos.__all__)


# ----------------------------------------------------------------------------- DGPO
def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _dgpo_reference(err, ref, adv, G, beta, old=None, eps=None):
    """Element by element: s_g = beta/G sum_i A_i (err_i - ref_i); loss_i = sigmoid(s_g) A_i err_i, and the
    gradient d loss_i / d err_i = sigmoid(s_g) A_i unless the clip holds err_i."""
    B = len(err)
    loss, grad = [0.0] * B, [0.0] * B
    for g in range(B // G):
        idx = range(g * G, (g + 1) * G)
        s = beta / G * sum(adv[i] * (err[i] - ref[i]) for i in idx)
        for i in idx:
            loss[i] = _sigmoid(s) * adv[i] * err[i]
            held = False
            if old is not None:
                rho = math.exp(old[i] - err[i])
                held = (adv[i] > 0 and rho > 1 + eps) or (adv[i] <= 0 and rho < 1 - eps)
            grad[i] = 0.0 if held else _sigmoid(s) * adv[i]
    return loss, grad


@pytest.mark.parametrize("clip", [False, True])
def test_dgpo_loss_matches_the_formula_values_and_gradients(clip):
    gen = torch.Generator().manual_seed(0)
    B, G, beta, eps = 8, 4, 2.5, 0.05
    err = torch.rand(B, generator=gen, dtype=torch.float64)
    ref = err + 0.3 * torch.randn(B, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    old = err + 0.2 * torch.randn(B, generator=gen, dtype=torch.float64) if clip else None
    x = err.clone().requires_grad_(True)
    loss = algos.dgpo_loss(x, ref, adv, G, beta, old, eps if clip else None)
    loss.sum().backward()
    want, want_grad = _dgpo_reference(err.tolist(), ref.tolist(), adv.tolist(), G, beta,
                                      old.tolist() if clip else None, eps)
    assert loss.tolist() == pytest.approx(want, rel=1e-12)
    assert x.grad.tolist() == pytest.approx(want_grad, rel=1e-12)
    if clip:
        assert 0 < sum(g == 0.0 for g in x.grad.tolist()) < B  # some held, some trained


def test_dgpo_gradient_is_that_of_the_group_softplus_and_k_timesteps_are_separate_groups():
    """(G / beta) x d/d err of sum_g softplus(s_g) (err not detached) is the surrogate's gradient; with [B, K] the
    K shared timesteps are K separate group sums."""
    gen = torch.Generator().manual_seed(1)
    B, G, K, beta = 6, 3, 2, 0.7
    err = torch.rand(B, K, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.rand(B, K, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    algos.dgpo_loss(err, ref, adv, G, beta).sum().backward()
    ours = err.grad.clone()
    err.grad = None
    s = beta / G * (adv[:, None] * (err - ref)).reshape(B // G, G, K).sum(1)
    torch.nn.functional.softplus(s).sum().backward()
    torch.testing.assert_close(ours, err.grad * G / beta)
    # beta -> 0: sigmoid(0) = 1/2, the advantage-weighted matching error
    torch.testing.assert_close(algos.dgpo_loss(err.detach(), ref, adv, G, 0.0), 0.5 * adv[:, None] * err.detach())
    with pytest.raises(ValueError, match="not whole groups"):
        algos.dgpo_loss(err.detach()[:5], ref[:5], adv[:5], G, beta)


# ----------------------------------------------------------------------------- GRPO-Guard
def test_ratio_norm_and_the_step_weight():
    gen = torch.Generator().manual_seed(2)
    lr = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    m = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    s = torch.rand(3, 4, generator=gen, dtype=torch.float64) + 0.1
    got = algos.ratio_norm(lr, m, s)
    for b in range(3):
        for t in range(4):
            sv = float(s[b, t])
            assert float(got[b, t]) == pytest.approx(sv * (float(lr[b, t]) + float(m[b, t]) / (2 * sv * sv)))
    # s = 1 and equal means: the log-ratio unchanged; the mean shift of an unbiased step is removed
    torch.testing.assert_close(algos.ratio_norm(lr, torch.zeros_like(m), torch.ones_like(s)), lr)
    mu_gap = torch.tensor([[0.3]], dtype=torch.float64)
    sigma = torch.tensor([[0.5]], dtype=torch.float64)
    x = torch.randn(200_000, generator=gen, dtype=torch.float64) * 0.5  # x ~ N(mu_old = 0, s^2)
    log_ratio = (-(x - 0.3) ** 2 + x ** 2) / (2 * 0.25)  # log N(x; mu_old + 0.3, s) - log N(x; mu_old, s)
    normed = algos.ratio_norm(log_ratio[None], (mu_gap ** 2).expand(1, x.numel()), sigma.expand(1, x.numel()))
    assert float(log_ratio.mean()) == pytest.approx(-0.09 / 0.5, abs=0.01)  # E = -m / (2 s^2): left-shifted
    assert float(normed.mean()) == pytest.approx(0.0, abs=0.01)
    dt = torch.tensor([[-0.25, -0.125]])
    assert algos.guard_step_weight(dt).tolist() == [[4.0, 8.0]]


# ----------------------------------------------------------------------------- Flow-DPPO
def test_dppo_mask_drops_far_steps_moving_with_their_advantage():
    gen = torch.Generator().manual_seed(3)
    B, T, D = 4, 5, 6
    mu = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    old = mu + 0.3 * torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    s = torch.full((B, T), 0.4, dtype=torch.float64)
    lr = torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.2], dtype=torch.float64)
    delta = 0.25
    keep = algos.dppo_mask(lr, mu, old, s, adv, delta)
    for b in range(B):
        for t in range(T):
            kl = sum((float(mu[b, t, d]) - float(old[b, t, d])) ** 2 for d in range(D)) / D / (2 * 0.4 ** 2)
            rho = math.exp(float(lr[b, t]))
            drop = kl >= delta and ((rho > 1 and adv[b] > 0) or (rho < 1 and adv[b] < 0))
            assert bool(keep[b, t]) is (not drop), (b, t)
    assert not keep.all() and keep.any()
    assert algos.dppo_mask(lr, mu, old, s, adv, math.inf).all()  # delta = inf: every step kept
    zero = algos.dppo_mask(lr, mu, old, s, adv, 0.0)  # delta = 0: every step moving with its advantage dropped
    assert torch.equal(zero, ~(((lr > 0) & (adv[:, None] > 0)) | ((lr < 0) & (adv[:, None] < 0))))
    assert not keep.requires_grad
