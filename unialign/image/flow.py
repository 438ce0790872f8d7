"""One stochastic flow-matching step x_sigma -> x_sigma' that also returns the step's log-density.

Origin: restated (not copied) from Flow-GRPO ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``
(yifan123/flow_grpo, ``sde_step_with_logprob``, both its ``sde_type`` branches; math in
Liu et al. 2025, Flow-GRPO, arXiv 2505.05470, section 4), on diffusers' ``FlowMatchEulerDiscreteScheduler``
(``sigmas`` with the terminal 0 appended by ``set_timesteps``, ``index_for_timestep``); checked against an
independent float64 restatement and against ``FlowMatchEulerDiscreteScheduler.step`` in
``tests/image/test_flow.py``.

Notation: sigma = sigmas[i] for the sample's timestep, sigma' = sigmas[i + 1], dt = sigma' - sigma < 0,
v = the (guided) velocity predicted by the model, eta = ``noise_level``.

``sde_type="sde"`` (Flow-GRPO): the Euler-Maruyama step of the reverse SDE that keeps the ODE's marginals,
with the score estimate -(x + (1 - sigma) v) / sigma:

    g    = eta * sqrt(sigma / (1 - s)),   s = sigma, except s = sigmas[1] where sigma == 1 (first step)
    mu   = x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt
    x'   = mu + g sqrt(-dt) z,  z ~ N(0, I)
    logp = mean_{C,H,W} log N(x'; mu, g^2 (-dt))

``sde_type="cps"`` (coefficient-preserving sampling, arXiv 2509.05952; Flow-GRPO's later branch):

    std  = sigma' sin(eta pi / 2);  x0_hat = x - sigma v;  x1_hat = x + (1 - sigma) v
    mu   = (1 - sigma') x0_hat + sqrt(sigma'^2 - std^2) x1_hat
    x'   = mu + std z
    logp = -mean_{C,H,W} (x' - mu)^2      (constants and 1/(2 std^2) dropped, as Flow-GRPO does: its ratios
                                           and clip ranges are not comparable with "sde"'s)

As eta -> 0 both means tend to the deterministic Euler step x + v dt of ``FlowMatchEulerDiscreteScheduler``.

Conventions (shared with ``unialign.image.ddim``):

* ``timestep`` is a tensor [B] of values from ``scheduler.timesteps`` (one per sample, so samples at
  different steps batch together) or one number for the whole batch; it is mapped to its index with
  ``scheduler.index_for_timestep`` (diffusers' rule, duplicates included).
* Log-probs are the **mean** over every non-batch dim (C,H,W, or L,D for packed FLUX latents), shape [B]
  (DDPO's convention; the PPO clip range 1e-4 assumes it).
* Everything is float32 whatever the model dtype: ``model_output``, ``sample`` and a given
  ``prev_sample`` are upcast first (Flow-GRPO: bf16 overflows in the mean), the step coefficients are
  computed in float64 on the CPU and cast once, and the returned ``prev_sample`` is float32 -- keep the
  trajectory in float32 and cast only the model's input, so the recorded latent is the one scored.
* ``prev_sample`` is detached for the log-density: gradients reach theta through mu only.
* Returned ``std_dev_t`` is the std of the step's Gaussian, i.e. of x' given x: g sqrt(-dt) for "sde"
  (Flow-GRPO returns g alone there and divides its KL by g^2; ``unialign.algos.kl.gaussian_kl``
  explains the |dt| factor) and sigma' sin(eta pi / 2) for "cps". So for "sde"
  ``gaussian_logprob_mean(prev_sample, prev_sample_mean, std_dev_t) == log_prob`` and
  ``flow_step_kl`` is the exact per-element KL of the step.
"""

from __future__ import annotations

import math

import torch

from unialign.algos.kl import gaussian_kl
from unialign.image.ddim import gaussian_logprob_mean

Tensor = torch.Tensor

SDE_TYPES = ("sde", "cps")


def check_noise_level(sde_type: str, noise_level: float) -> None:
    """ValueError unless ``sde_type`` is one of ``SDE_TYPES`` and ``noise_level`` (eta) fits it: > 0 for "sde"
    (its log-density is undefined at 0), in [0, 1] for "cps" (std = sigma' sin(eta pi / 2))."""
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    if sde_type == "sde" and not noise_level > 0:
        raise ValueError(f"noise_level must be > 0 for sde_type='sde' (its log-density is undefined at 0); "
                         f"got {noise_level}")
    if sde_type == "cps" and not 0 <= noise_level <= 1:
        raise ValueError(f"noise_level must be in [0, 1] for sde_type='cps' (std = sigma' sin(noise_level pi/2)); "
                         f"got {noise_level}")


def sde_window_bounds(num_steps: int, window_size: int, window_range: tuple[int, int] | None) -> tuple[int, int]:
    """(lo, hi) of the steps an SDE window of ``window_size`` may start in (``window_range``, default all N);
    ValueError unless 0 <= size <= hi - lo and 0 <= lo < hi <= num_steps."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    lo, hi = window_range if window_range is not None else (0, num_steps)
    if window_size < 0 or not 0 <= lo < hi <= num_steps or window_size > hi - lo:
        raise ValueError(f"sde_window_size={window_size} with sde_window_range=({lo}, {hi}) must satisfy "
                         f"0 <= size <= hi - lo and 0 <= lo < hi <= num_steps={num_steps}")
    return lo, hi


def flow_step_indices(scheduler, timestep: Tensor | float, batch: int) -> Tensor:
    """Scheduler indices i (long [B], CPU) of ``timestep`` (tensor [B] or one number) in
    ``scheduler.timesteps``, by ``scheduler.index_for_timestep``. One host transfer for the batch."""
    if getattr(scheduler, "num_inference_steps", None) is None:
        raise ValueError("call scheduler.set_timesteps(num_steps) before stepping")
    t = torch.as_tensor(timestep).detach().reshape(-1).cpu()
    if t.numel() == 1:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"timestep must be a number or a tensor of shape [{batch}], got {tuple(t.shape)}")
    schedule = scheduler.timesteps.detach().cpu()
    out = []
    for value in t:
        if not bool((schedule == value).any()):
            raise ValueError(f"timestep {value.item()} is not one of scheduler.timesteps "
                             f"(first {schedule[0].item()}, last {schedule[-1].item()})")
        out.append(scheduler.index_for_timestep(value, schedule))
    return torch.tensor(out, dtype=torch.long)


def flow_step_coefficients(scheduler, timestep: Tensor | float, batch: int, noise_level: float = 0.7,
                           sde_type: str = "sde") -> dict[str, Tensor]:
    """Per-sample float64 scalars of the step (module docstring), each [B] on CPU:
    ``sigma``, ``sigma_next``, ``dt``, ``std`` (of x' given x), and ``x_coef``, ``v_coef`` with
    mu = x_coef * x + v_coef * v.

    sde:  x_coef = 1 + g^2 dt / (2 sigma),  v_coef = (1 + g^2 (1 - sigma) / (2 sigma)) dt,  std = g sqrt(-dt)
    cps:  with c = sqrt(sigma'^2 - std^2):  x_coef = (1 - sigma') + c,  v_coef = -sigma (1 - sigma') + c (1 - sigma)
    """
    check_noise_level(sde_type, noise_level)
    index = flow_step_indices(scheduler, timestep, batch)
    sigmas = scheduler.sigmas.detach().to(device="cpu", dtype=torch.float64)
    if index.max().item() + 1 >= len(sigmas):
        raise ValueError("scheduler.sigmas lacks the next sigma (call scheduler.set_timesteps first)")
    sigma, sigma_next = sigmas[index], sigmas[index + 1]
    if (sigma <= 0).any() or (sigma > 1).any():
        raise ValueError(f"flow-matching sigmas must lie in (0, 1] at a step, got {sigma.tolist()}")
    dt = sigma_next - sigma
    if sde_type == "sde":
        denominator = 1 - torch.where(sigma == 1, sigmas[1], sigma)
        g = noise_level * torch.sqrt(sigma / denominator)
        x_coef = 1 + g**2 * dt / (2 * sigma)
        v_coef = (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt
        std = g * torch.sqrt(-dt)
    else:
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        c = torch.sqrt((sigma_next**2 - std**2).clamp(min=0))
        x_coef = (1 - sigma_next) + c
        v_coef = -sigma * (1 - sigma_next) + c * (1 - sigma)
    return {"sigma": sigma, "sigma_next": sigma_next, "dt": dt, "std": std, "x_coef": x_coef, "v_coef": v_coef}


def sde_step_with_logprob(
    scheduler,
    model_output: Tensor,
    timestep: Tensor | float,
    sample: Tensor,
    noise_level: float = 0.7,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    sde_type: str = "sde",
    coefficients: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flow-matching SDE step with log-probability (math and conventions in the module docstring).

    Args:
        scheduler: a ``diffusers.FlowMatchEulerDiscreteScheduler`` after ``set_timesteps(N)``.
        model_output: [B, ...] the (guided) velocity v, any float dtype.
        timestep: tensor [B] of values of ``scheduler.timesteps`` (or one number for the batch).
        sample: [B, ...] the current latent x (same shape as ``model_output``).
        noise_level: eta; > 0 for "sde", in [0, 1] for "cps" (Flow-GRPO: 0.7 for "sde", 0.8 for "cps").
        prev_sample: [B, ...] a recorded x' to score; when None it is drawn as mu + std z with z from
            ``generator`` (float32, as ``diffusers.utils.torch_utils.randn_tensor`` draws it).
        sde_type: "sde" (Flow-GRPO) or "cps" (coefficient-preserving).
        coefficients: ``flow_step_coefficients(...)`` of the same arguments, computed beforehand (a
            sampler computes every step's once; saves the per-call timestep lookup).
    Returns:
        prev_sample [B, ...] float32; log_prob [B] float32 (mean over non-batch dims); prev_sample_mean
        [B, ...] float32 (differentiable in ``model_output``); std_dev_t [B, 1, ...] float32, the std of
        x' given x (not Flow-GRPO's g for "sde"; see the module docstring).
    """
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output {tuple(model_output.shape)} and sample {tuple(sample.shape)} differ in shape")
    batch = sample.shape[0]
    coef = (flow_step_coefficients(scheduler, timestep, batch, noise_level, sde_type)
            if coefficients is None else coefficients)
    view = (batch,) + (1,) * (sample.dim() - 1)
    x_coef, v_coef, std = (coef[k].to(device=sample.device, dtype=torch.float32).view(view)
                           for k in ("x_coef", "v_coef", "std"))
    x, v = sample.float(), model_output.float()
    mean = x_coef * x + v_coef * v

    if prev_sample is None:
        from diffusers.utils.torch_utils import randn_tensor

        noise = randn_tensor(tuple(sample.shape), generator=generator, device=sample.device, dtype=torch.float32)
        prev_sample = mean.detach() + std * noise
    prev_sample = prev_sample.detach().float()
    if sde_type == "sde":
        log_prob = gaussian_logprob_mean(prev_sample, mean, std)
    else:
        log_prob = -((prev_sample - mean) ** 2).mean(dim=tuple(range(1, mean.dim())))
    return prev_sample, log_prob, mean, std


def flow_step_kl(prev_sample_mean: Tensor, ref_prev_sample_mean: Tensor, std_dev_t: Tensor) -> Tensor:
    """Closed-form KL(N(mu, std^2 I) || N(mu_ref, std^2 I)) of one step, mean over non-batch dims -> [B].

    ``prev_sample_mean`` / ``ref_prev_sample_mean``: [B, ...] the means of the policy and the reference
    at the same x; ``std_dev_t``: the std returned by ``sde_step_with_logprob`` (the same for both: it
    does not depend on the model). ``unialign.algos.kl.gaussian_kl`` with a check: a step of std 0 (the
    last "cps" step, sigma' = 0) is deterministic and has no finite KL. Flow-GRPO's "sde" KL divides by
    g^2 instead of std^2 = g^2 |dt|, i.e. it equals this times |dt|."""
    if (std_dev_t <= 0).any():
        raise ValueError("flow_step_kl: a step with std 0 (the last 'cps' step) is deterministic; "
                         "its Gaussian KL is not finite -- leave that step out")
    return gaussian_kl(prev_sample_mean.float(), ref_prev_sample_mean.float(), std_dev_t.float())
