"""Flow-matching SDE step with log-prob (unialign/image/flow.py) against an independent float64 numpy
restatement of Flow-GRPO's formulas (arXiv 2505.05470; yifan123/flow_grpo sd3_sde_with_logprob.py), against diffusers' Euler step as eta -> 0,
and against torch.distributions' Gaussian log-density."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from tests.helpers import assert_close
from unialign.image.flow import flow_step_kl, sde_step_with_logprob

NUM_STEPS = 10
SHAPE = (4, 8, 8)  # C, H, W


def _scheduler(shift: float = 3.0, num_steps: int = NUM_STEPS) -> FlowMatchEulerDiscreteScheduler:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)  # SD3's config
    scheduler.set_timesteps(num_steps)
    return scheduler


def _reference(sigmas: np.ndarray, timesteps: np.ndarray, t: np.ndarray, x: np.ndarray, v: np.ndarray,
               eta: float, sde_type: str, prev: np.ndarray | None = None, z: np.ndarray | None = None):
    """The issue's / Flow-GRPO's formulas in float64 numpy, per sample, written without the module's
    helpers: returns (prev_sample, log_prob [B], mean, step std [B])."""
    means, stds, prevs, logps = [], [], [], []
    for b in range(len(t)):
        i = int(np.nonzero(timesteps == t[b])[0][0])
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        dt = s_next - s
        xb, vb = x[b].astype(np.float64), v[b].astype(np.float64)
        if sde_type == "sde":
            g = eta * math.sqrt(s / (1 - (float(sigmas[1]) if s == 1 else s)))
            mean = xb * (1 + g**2 * dt / (2 * s)) + vb * (1 + g**2 * (1 - s) / (2 * s)) * dt
            std = g * math.sqrt(-dt)
        else:
            std = s_next * math.sin(eta * math.pi / 2)
            x0, x1 = xb - s * vb, xb + (1 - s) * vb
            mean = (1 - s_next) * x0 + math.sqrt(s_next**2 - std**2) * x1
        xp = prev[b].astype(np.float64) if prev is not None else mean + std * z[b]
        if sde_type == "sde":
            logp = np.mean(-((xp - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi))
        else:
            logp = -np.mean((xp - mean) ** 2)
        means.append(mean), stds.append(std), prevs.append(xp), logps.append(logp)
    return np.stack(prevs), np.array(logps), np.stack(means), np.array(stds)


def _inputs(batch: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, *SHAPE), generator=g).to(dtype)
    v = torch.randn((batch, *SHAPE), generator=g).to(dtype)
    return x, v


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


@pytest.mark.parametrize("sde_type,eta", [("sde", 0.7), ("cps", 0.8)])
@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("which", ["first", "last", "mixed"])
def test_matches_float64_restatement(sde_type, eta, shift, which):
    """Mean, std and the log-prob of a given x' (drawn independently) on the first step (sigma = 1, the
    sigmas[1] substitution), the last (sigma' = 0) and a batch of different timesteps."""
    scheduler = _scheduler(shift)
    steps = {"first": [0, 0], "last": [NUM_STEPS - 1, NUM_STEPS - 1], "mixed": [0, 4, NUM_STEPS - 1, 7, 2]}[which]
    t = scheduler.timesteps[steps]
    x, v = _inputs(len(steps))
    z = np.random.default_rng(1).standard_normal((len(steps), *SHAPE))
    sigmas, timesteps = _np(scheduler.sigmas), _np(scheduler.timesteps)
    prev_ref, logp_ref, mean_ref, std_ref = _reference(sigmas, timesteps, _np(t), _np(x), _np(v), eta, sde_type, z=z)

    prev, logp, mean, std = sde_step_with_logprob(scheduler, v, t, x, noise_level=eta,
                                                  prev_sample=torch.from_numpy(prev_ref).float(), sde_type=sde_type)
    assert prev.dtype == logp.dtype == mean.dtype == std.dtype == torch.float32
    assert logp.shape == (len(steps),) and std.shape == (len(steps), 1, 1, 1) and mean.shape == x.shape
    assert_close(mean, mean_ref)
    assert_close(std.flatten(), std_ref)
    assert_close(logp, logp_ref)
    if which == "first":
        assert float(scheduler.sigmas[0]) == 1.0
    if which == "last":
        assert float(scheduler.sigmas[-1]) == 0.0
        if sde_type == "cps":  # sigma' = 0: the last CPS step is deterministic, x' = x0_hat
            assert (std == 0).all()
            assert_close(mean, _np(x) - float(scheduler.sigmas[NUM_STEPS - 1]) * _np(v))


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_first_sde_step_has_std_equal_to_noise_level(shift):
    """Anchor (Flow-GRPO's SDE step): at sigma = 1, g^2 = eta^2 / (1 - sigmas[1]) and -dt = 1 - sigmas[1],
    so the step's std is eta exactly."""
    scheduler = _scheduler(shift)
    x, v = _inputs(2)
    t = scheduler.timesteps[:1].expand(2)
    for eta in (0.3, 0.7, 1.0):
        _, _, _, std = sde_step_with_logprob(scheduler, v, t, x, noise_level=eta)
        assert_close(std.flatten(), torch.full((2,), eta, dtype=torch.float64))


@pytest.mark.parametrize("sde_type,eta", [("sde", 1e-4), ("cps", 0.0)])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_mean_tends_to_the_schedulers_euler_step(sde_type, eta, shift):
    """Along a whole trajectory, the step's mean at eta -> 0 equals FlowMatchEulerDiscreteScheduler.step
    (x + v dt); at eta = 0.7 it does not (the test can fail)."""
    scheduler = _scheduler(shift)
    x, _ = _inputs(2)
    for i, t in enumerate(scheduler.timesteps):
        v = 0.5 * x + torch.sin(torch.arange(x.numel()).float().view_as(x) + i)  # any x-dependent "model"
        euler = scheduler.step(v, t, x).prev_sample
        _, _, mean, _ = sde_step_with_logprob(scheduler, v, t.expand(2), x, noise_level=eta, sde_type=sde_type)
        assert_close(mean, euler, msg=f"step {i}")
        if i < NUM_STEPS - 1:  # at sigma' = 0 the cps mean is x0_hat = the Euler step for any eta
            _, _, noisy_mean, _ = sde_step_with_logprob(scheduler, v, t.expand(2), x, noise_level=0.7,
                                                        sde_type=sde_type)
            assert (noisy_mean - euler).abs().max() > 1e-3
        x = euler


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_bf16_inputs_are_computed_in_float32(sde_type):
    """bf16 model output and latent: every output is float32 and equals the float64 restatement of the
    (exactly upcast) bf16 values at float32 tolerance -- a bf16 computation would miss by ~1e-2."""
    scheduler = _scheduler(3.0)
    t = scheduler.timesteps[[0, 3, 8]]
    x, v = _inputs(3, dtype=torch.bfloat16)
    x, v = x * 30, v * 30  # large latents: the regime where a bf16 mean loses digits
    z = np.random.default_rng(2).standard_normal((3, *SHAPE))
    sigmas, timesteps = _np(scheduler.sigmas), _np(scheduler.timesteps)
    prev_ref, logp_ref, mean_ref, _ = _reference(sigmas, timesteps, _np(t), _np(x), _np(v), 0.7, sde_type, z=z)
    prev, logp, mean, std = sde_step_with_logprob(scheduler, v, t, x, prev_sample=torch.from_numpy(prev_ref).float(),
                                                  sde_type=sde_type)
    assert {prev.dtype, logp.dtype, mean.dtype, std.dtype} == {torch.float32}
    torch.testing.assert_close(mean.double(), torch.from_numpy(mean_ref), rtol=1e-5, atol=3e-5)
    assert_close(logp, logp_ref, dtype=torch.float32)
    bf16_mean = (x + (scheduler.sigmas[[1, 4, 9]] - scheduler.sigmas[[0, 3, 8]]).view(3, 1, 1, 1).bfloat16() * v)
    assert (bf16_mean.double() - mean.double()).abs().max() > 1e-2  # what the float32 upcast avoids


def test_sde_logprob_is_the_gaussian_density_of_a_given_sample():
    """log N(x'; mu, std^2) averaged over C,H,W, by torch.distributions in float64, at any x' (not only
    on-policy draws), and gradients reach the model output through mu only."""
    scheduler = _scheduler(3.0)
    t = scheduler.timesteps[[1, 5, 9]]
    x, v = _inputs(3)
    v.requires_grad_(True)
    given = torch.randn((3, *SHAPE), generator=torch.Generator().manual_seed(5)) * 0.3 + x
    prev, logp, mean, std = sde_step_with_logprob(scheduler, v, t, x, noise_level=0.7, prev_sample=given)
    normal = torch.distributions.Normal(mean.detach().double(), std.double().expand_as(mean))
    assert_close(logp, normal.log_prob(given.double()).mean(dim=(1, 2, 3)))
    assert torch.equal(prev, given) and not prev.requires_grad
    logp.sum().backward()
    # d/dv of mean_D log N = mean_D (x' - mu)/std^2 * d mu/dv, d mu/dv = v_coef: nonzero and finite
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_generator_determinism_and_on_policy_draw(sde_type):
    scheduler = _scheduler(3.0)
    t = scheduler.timesteps[[0, 2, 6]]
    x, v = _inputs(3)
    a = sde_step_with_logprob(scheduler, v, t, x, generator=torch.Generator().manual_seed(7), sde_type=sde_type)
    b = sde_step_with_logprob(scheduler, v, t, x, generator=torch.Generator().manual_seed(7), sde_type=sde_type)
    c = sde_step_with_logprob(scheduler, v, t, x, generator=torch.Generator().manual_seed(8), sde_type=sde_type)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    z = torch.randn((3, *SHAPE), generator=torch.Generator().manual_seed(7))  # randn_tensor's draw on CPU
    torch.testing.assert_close(a[0], a[2] + a[3] * z, rtol=0, atol=1e-6)
    # scoring the drawn sample again gives the recorded log-prob (ratio 1 on-policy)
    again = sde_step_with_logprob(scheduler, v, t, x, prev_sample=a[0], sde_type=sde_type)
    torch.testing.assert_close(again[1], a[1], rtol=0, atol=0)
    if sde_type == "sde":  # E[logp] = -ln std - 1/2 ln 2pi - 1/2, per-sample sd ~ sqrt(1/(2D)) = 0.04
        expected = -a[3].flatten().log() - 0.5 * math.log(2 * math.pi) - 0.5
        assert (a[1] - expected).abs().max() < 0.2


def test_batch_of_timesteps_equals_one_call_per_sample():
    scheduler = _scheduler(3.0)
    steps = [9, 0, 4, 4]
    t = scheduler.timesteps[steps]
    x, v = _inputs(len(steps))
    prev = x + 0.1 * v
    for sde_type in ("sde", "cps"):
        _, logp, mean, std = sde_step_with_logprob(scheduler, v, t, x, prev_sample=prev, sde_type=sde_type)
        for b in range(len(steps)):
            _, lb, mb, sb = sde_step_with_logprob(scheduler, v[b:b + 1], t[b], x[b:b + 1], prev_sample=prev[b:b + 1],
                                                  sde_type=sde_type)
            torch.testing.assert_close(logp[b:b + 1], lb, rtol=0, atol=0)
            torch.testing.assert_close(mean[b:b + 1], mb, rtol=0, atol=0)
            torch.testing.assert_close(std[b:b + 1], sb, rtol=0, atol=0)


def test_closed_form_kl_of_the_step():
    """flow_step_kl = mean_D (mu - mu_ref)^2 / (2 std^2) in float64, and it is what the mean log-ratio
    log pi - log pi_ref concentrates at for x' ~ pi (k1); the deterministic last cps step is refused."""
    scheduler = _scheduler(3.0)
    t = scheduler.timesteps[[1, 5, 8]]
    x, v = _inputs(3)
    v_ref = v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(3))
    prev, logp, mean, std = sde_step_with_logprob(scheduler, v, t, x, generator=torch.Generator().manual_seed(4))
    _, logp_ref, mean_ref, std_ref = sde_step_with_logprob(scheduler, v_ref, t, x, prev_sample=prev)
    assert torch.equal(std, std_ref)
    kl = flow_step_kl(mean, mean_ref, std)
    expected = ((_np(mean) - _np(mean_ref)) ** 2).mean(axis=(1, 2, 3)) / (2 * _np(std).flatten() ** 2)
    assert_close(kl, expected)
    # k1 at one draw: KL + (per-element noise of sd sqrt(2 KL / D))
    assert ((logp - logp_ref) - kl).abs().max() < 4 * (2 * kl.max() / math.prod(SHAPE)).sqrt() + 1e-6
    _, _, mean_c, std_c = sde_step_with_logprob(scheduler, v[:1], scheduler.timesteps[-1:], x[:1], sde_type="cps")
    with pytest.raises(ValueError, match="std 0"):
        flow_step_kl(mean_c, mean_c, std_c)


def test_bad_arguments_fail_with_a_clear_message():
    scheduler = _scheduler(3.0)
    x, v = _inputs(2)
    with pytest.raises(ValueError, match="not one of scheduler.timesteps"):
        sde_step_with_logprob(scheduler, v, torch.tensor([1000.0, 123.0]), x)
    with pytest.raises(ValueError, match="shape \\[2\\]"):
        sde_step_with_logprob(scheduler, v, scheduler.timesteps[:3], x)
    with pytest.raises(ValueError, match="noise_level must be > 0"):
        sde_step_with_logprob(scheduler, v, scheduler.timesteps[:2], x, noise_level=0.0)
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(scheduler, v, scheduler.timesteps[:2], x, sde_type="ode")
    with pytest.raises(ValueError, match="set_timesteps"):
        sde_step_with_logprob(FlowMatchEulerDiscreteScheduler(), v, torch.tensor([1000.0, 1000.0]), x)


def test_precomputed_coefficients_give_the_same_step():
    """A sampler computes every step's coefficients once (no timestep lookup per call): same result."""
    from unialign.image.flow import flow_step_coefficients

    scheduler = _scheduler(3.0)
    t = scheduler.timesteps[[0, 6, 9]]
    x, v = _inputs(3)
    for sde_type in ("sde", "cps"):
        coef = flow_step_coefficients(scheduler, t, 3, noise_level=0.7, sde_type=sde_type)
        assert all(c.dtype == torch.float64 and c.shape == (3,) for c in coef.values())
        a = sde_step_with_logprob(scheduler, v, t, x, generator=torch.Generator().manual_seed(0), sde_type=sde_type)
        b = sde_step_with_logprob(scheduler, v, t, x, generator=torch.Generator().manual_seed(0), sde_type=sde_type,
                                  coefficients=coef)
        for left, right in zip(a, b):
            torch.testing.assert_close(left, right, rtol=0, atol=0)
