"""DDIM step with log-prob: parity with diffusers, the SD1.5 anchor table, float64 numpy log-density."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler

from tests.helpers import assert_close
from tests.image.conftest import SD15_SCHEDULER
from unialign.image import ddim_step_coefficients, ddim_step_with_logprob, gaussian_logprob_mean

# DDIM (Song et al. 2021, eqs. 12 and 16) as ddpo-pytorch's ddim_with_logprob.py (SD1.5 config, N = 50, eta = 1),
# computed independently in float64 numpy:
# t: (a_t, a_prev, sigma^2, sigma, ln sigma, coef on eps_hat)
ANCHORS = {
    981: (0.0057755, 0.0072817, 0.206537, 0.454463, -0.788638, 0.886669),
    501: (0.274999, 0.302296, 0.0868979, 0.294785, -1.22151, 0.781541),
    21: (0.980381, 0.998296, 0.00155863, 0.0394795, -3.23197, 0.0120556),
    1: (0.998296, 0.999150, 0.000426353, 0.0206483, -3.88012, 0.0205827),
}


def _scheduler(num_steps: int = 50, **overrides) -> DDIMScheduler:
    scheduler = DDIMScheduler(**{**SD15_SCHEDULER, **overrides})
    scheduler.set_timesteps(num_steps)
    return scheduler


def test_sd15_anchor_table():
    scheduler = _scheduler()
    assert scheduler.timesteps[0] == 981 and scheduler.timesteps[-1] == 1
    t = torch.tensor(list(ANCHORS))
    c = ddim_step_coefficients(scheduler, t, eta=1.0)
    got = torch.stack([c["alpha_prod_t"], c["alpha_prod_prev"], c["std"] ** 2, c["std"], c["std"].log(),
                       c["eps_coef"]], dim=1)
    expected = torch.tensor(list(ANCHORS.values()), dtype=torch.float64)
    # The table is printed to 6 significant digits (relative rounding <= 1e-5).
    torch.testing.assert_close(got[:, :5], expected[:, :5], rtol=1e-5, atol=0)
    # sqrt(1 - a_prev - sigma^2) at t = 1 is sqrt(8.5e-4 - 4.3e-4): the cancellation amplifies the float32
    # rounding of diffusers' alphas_cumprod (~3e-8 absolute) to ~3e-5 relative; the other rows hold 1e-5.
    torch.testing.assert_close(got[:3, 5], expected[:3, 5], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[3, 5], expected[3, 5], rtol=5e-5, atol=0)


def test_coefficients_match_float64_numpy_formula():
    scheduler = _scheduler()
    acp = scheduler.alphas_cumprod.double().numpy()
    t = np.array([981, 741, 501, 261, 21, 1])
    t_prev = np.clip(t - 20, 0, 999)
    a, ap = acp[t], acp[t_prev]
    eta = 0.7
    std = eta * np.sqrt((1 - ap) / (1 - a) * (1 - a / ap))
    c = ddim_step_coefficients(scheduler, torch.tensor(t), eta=eta)
    assert_close(c["std"], std)
    assert_close(c["eps_coef"], np.sqrt(1 - ap - std**2))
    assert_close(c["alpha_prod_prev"], ap)


def test_last_step_uses_alphas_cumprod_0_even_with_set_alpha_to_one():
    # ddpo's clamp: t' = clamp(1 - 20, 0) = 0 -> a_prev = alphas_cumprod[0], never final_alpha_cumprod.
    for set_alpha_to_one in (False, True):
        scheduler = _scheduler(set_alpha_to_one=set_alpha_to_one)
        c = ddim_step_coefficients(scheduler, 1)
        assert_close(c["alpha_prod_prev"], scheduler.alphas_cumprod[0].double())
        assert c["std"].item() > 0


def _float64_copy(scheduler: DDIMScheduler) -> DDIMScheduler:
    """The same scheduler evaluated in float64 (diffusers keeps its scalars in float32)."""
    copy = DDIMScheduler.from_config(scheduler.config)
    copy.set_timesteps(scheduler.num_inference_steps)
    copy.alphas_cumprod = scheduler.alphas_cumprod.double()
    copy.final_alpha_cumprod = scheduler.final_alpha_cumprod.double()
    return copy


@pytest.mark.parametrize(
    "prediction_type, extra",
    [("epsilon", {}), ("v_prediction", {}), ("sample", {}), ("epsilon", {"clip_sample": True}),
     ("epsilon", {"thresholding": True, "sample_max_value": 1.2})],
)
def test_parity_with_diffusers_step(prediction_type, extra):
    """prev_sample == diffusers DDIMScheduler.step(eta=1, variance_noise=z) for the same z.

    Reference: diffusers' own step evaluated in float64 for every prediction type; and stock float32
    diffusers for epsilon / v. (Stock float32 diffusers with sample prediction is 1.6e-5 off its own
    float64 value at t=1: (x_t - sqrt(a) x0) / sqrt(1 - a) and 1 - a_t / a_prev cancel; we compute the
    coefficients in float64 so we match the float64 value.)"""
    scheduler = _scheduler(prediction_type=prediction_type, **extra)
    scheduler64 = _float64_copy(scheduler)
    g = torch.Generator().manual_seed(0)
    # one sample per timestep, batched, including the last step 1 -> 0
    t_B = torch.tensor([981, 501, 261, 21, 1])
    sample = torch.randn(5, 4, 8, 8, generator=g)
    model_output = torch.randn(5, 4, 8, 8, generator=g)
    z = torch.randn(5, 4, 8, 8, generator=torch.Generator().manual_seed(7))

    prev, logp = ddim_step_with_logprob(scheduler, model_output, t_B, sample, eta=1.0,
                                        generator=torch.Generator().manual_seed(7))
    for i, t in enumerate(t_B.tolist()):
        row = slice(i, i + 1)
        ref64 = scheduler64.step(model_output[row].double(), t, sample[row].double(), eta=1.0,
                                 variance_noise=z[row].double()).prev_sample
        assert_close(prev[row], ref64, msg=f"float64 diffusers, t={t}")
        if prediction_type != "sample":
            ref = scheduler.step(model_output[row], t, sample[row], eta=1.0, variance_noise=z[row]).prev_sample
            assert_close(prev[row], ref, msg=f"stock diffusers, t={t}")
        # scoring the diffusers sample under our Gaussian gives the value recorded for our own sample
        _, logp_ref = ddim_step_with_logprob(scheduler, model_output[row], t, sample[row], prev_sample=ref64.float())
        assert_close(logp[i], logp_ref[0])


def test_logprob_equals_float64_numpy_gaussian():
    scheduler = _scheduler(prediction_type="v_prediction")
    g = torch.Generator().manual_seed(1)
    t_B = torch.tensor([961, 21])
    x_t, v, x_prev = (torch.randn(2, 3, 4, 5, generator=g) for _ in range(3))
    prev, logp = ddim_step_with_logprob(scheduler, v, t_B, x_t, eta=1.0, prev_sample=x_prev)
    assert torch.equal(prev, x_prev)

    acp = scheduler.alphas_cumprod.double().numpy()
    xt, vv, xp = (a.double().numpy() for a in (x_t, v, x_prev))
    expected = []
    for i, t in enumerate(t_B.tolist()):
        a, ap = acp[t], acp[max(t - 20, 0)]
        x0 = math.sqrt(a) * xt[i] - math.sqrt(1 - a) * vv[i]
        eps = math.sqrt(a) * vv[i] + math.sqrt(1 - a) * xt[i]
        var = (1 - ap) / (1 - a) * (1 - a / ap)
        mu = math.sqrt(ap) * x0 + math.sqrt(1 - ap - var) * eps
        dens = -((xp[i] - mu) ** 2) / (2 * var) - 0.5 * math.log(var) - 0.5 * math.log(2 * math.pi)
        expected.append(dens.mean())
    assert_close(logp, np.array(expected))


def test_on_policy_logprob_is_the_noise_density():
    # right after sampling x' - mu = sigma z, so logp = -ln sigma - 1/2 ln 2 pi - 1/2 mean(z^2)
    scheduler = _scheduler()
    g = torch.Generator().manual_seed(2)
    x_t, eps = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    _, logp = ddim_step_with_logprob(scheduler, eps, 501, x_t, generator=torch.Generator().manual_seed(3))
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3)).double()
    expected = -math.log(ANCHORS[501][3]) - 0.5 * math.log(2 * math.pi) - 0.5 * (z**2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(logp.double(), expected, rtol=1e-5, atol=2e-5)  # sigma from a 6-digit table


def test_gradient_flows_through_mean_only():
    scheduler = _scheduler()
    eps = torch.randn(1, 4, 8, 8, requires_grad=True)
    x_prev = torch.randn(1, 4, 8, 8, requires_grad=True)
    _, logp = ddim_step_with_logprob(scheduler, eps, 501, torch.randn(1, 4, 8, 8), prev_sample=x_prev)
    logp.sum().backward()
    assert eps.grad is not None and eps.grad.abs().sum() > 0
    assert x_prev.grad is None


def test_gaussian_logprob_mean_against_numpy():
    g = torch.Generator().manual_seed(4)
    x, mean = torch.randn(3, 2, 5, generator=g, dtype=torch.float64), torch.randn(3, 2, 5, generator=g, dtype=torch.float64)
    std = torch.tensor([0.3, 1.0, 2.5], dtype=torch.float64).view(3, 1, 1)
    xn, mn, sn = x.numpy(), mean.numpy(), std.numpy()
    expected = (-((xn - mn) ** 2) / (2 * sn**2) - np.log(sn) - 0.5 * np.log(2 * np.pi)).reshape(3, -1).mean(1)
    assert_close(gaussian_logprob_mean(x, mean, std), expected)


@pytest.mark.parametrize("eta", [0.0, -0.5])
def test_nonpositive_eta_raises(eta):
    scheduler = _scheduler()
    with pytest.raises(ValueError, match="eta must be > 0"):
        ddim_step_with_logprob(scheduler, torch.zeros(1, 4, 2, 2), 501, torch.zeros(1, 4, 2, 2), eta=eta)


def test_precomputed_coefficients_give_the_same_step():
    """A sampler computes every step's coefficients once (no host sync per step): same sample, same log-prob."""
    sched = _scheduler(20)
    x = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    eps = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    all_steps = ddim_step_coefficients(sched, sched.timesteps, 1.0)
    for i in (0, 7, 19):
        t = int(sched.timesteps[i])
        plain = ddim_step_with_logprob(sched, eps, t, x, eta=1.0, generator=torch.Generator().manual_seed(2))
        pre = ddim_step_with_logprob(sched, eps, t, x, eta=1.0, generator=torch.Generator().manual_seed(2),
                                     coefficients={k: v[i].expand(3) for k, v in all_steps.items()})
        assert torch.equal(plain[0], pre[0]) and torch.equal(plain[1], pre[1])
