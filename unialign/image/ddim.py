"""One DDIM denoising step x_t -> x_{t'} that also returns the step's Gaussian log-density.

Origin: adapted (rewritten, not copied) from ddpo-pytorch
``ddpo_pytorch/diffusers_patch/ddim_with_logprob.py`` (kvablack/ddpo-pytorch @ 1958463, itself a patch
of diffusers 0.17 ``DDIMScheduler.step``), and checked against diffusers 0.42
``schedulers/scheduling_ddim.py::DDIMScheduler.step`` (parity test in ``tests/image/test_ddim.py``).

The update is formulas (12) and (16) of the DDIM paper (Song et al. 2021):

    x0_hat = (x_t - sqrt(1 - a_t) eps_hat) / sqrt(a_t)                   (epsilon prediction)
    sigma_t = eta * sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
    mu     = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - sigma_t^2) eps_hat
    x_prev = mu + sigma_t z,  z ~ N(0, I)

with a_t = alphas_cumprod[t]. What changed against ``DDIMScheduler.step``:

* ``timestep`` may be a tensor [B] (one timestep per sample), so samples at different steps can be
  batched (training sub-samples steps per sample).
* ``prev_sample`` may be given (training re-scores a recorded transition), and the log-density of
  ``prev_sample`` under N(mu, sigma_t^2 I), **averaged** over C,H,W, is returned with shape [B].
  ``prev_sample`` is detached, so gradients reach theta through mu only; sigma_t does not depend on theta.
* The previous timestep is clamped: t' = clamp(t - T // N, 0, T - 1), and a_prev = alphas_cumprod[t'].
  This is ddpo-pytorch's subtlety: because of the clamp, the ``final_alpha_cumprod`` branch of diffusers
  is never taken, so the last step always uses alphas_cumprod[0]. For SD1.x / SDXL
  (``set_alpha_to_one=False``, where final_alpha_cumprod == alphas_cumprod[0]) this equals stock
  diffusers exactly. With ``set_alpha_to_one=True`` stock diffusers would use a_prev = 1, which makes
  sigma_t = 0 at the last step and its log-density -inf; the clamp keeps every step a proper Gaussian,
  at the price of a last step that differs from stock diffusers.
* eta must be > 0 (eta = 0 is deterministic DDIM, whose "log-prob" is undefined); eta = 1 is DDPO's
  default (the DDPM posterior variance).
* The step coefficients are computed in float64, the update in float32, and ``prev_sample`` is cast back to the
  input dtype *before* its log-prob is taken (ddpo scores the unrounded value), so a half-precision
  sampler records a latent and a log-prob that agree. ``use_clipped_model_output`` is not supported (ddpo does not use it either).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_logprob_mean(x: Tensor, mean: Tensor, std: Tensor | float) -> Tensor:
    """log N(x; mean, std^2) per element, averaged over every non-batch dim -> [B].

    ``x``, ``mean``: [B, ...]; ``std``: broadcastable to them (e.g. [B, 1, 1, 1]), > 0.
    """
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    logp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - HALF_LOG_2PI
    return logp.mean(dim=tuple(range(1, logp.dim())))


def _as_batched_timesteps(timestep: Tensor | int, batch: int, device: torch.device) -> Tensor:
    t = torch.as_tensor(timestep, device=device).long()
    if t.dim() == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"timestep must be an int or a tensor of shape [{batch}], got {tuple(t.shape)}")
    return t


def ddim_step_coefficients(scheduler, timestep: Tensor | int, eta: float = 1.0) -> dict[str, Tensor]:
    """Per-sample scalars of the step at ``timestep`` ([B] or int): alpha_prod_t, alpha_prod_prev
    (of the clamped t'), std (sigma_t) and eps_coef = sqrt(1 - a_prev - sigma_t^2), each [B].

    Computed in float64 from the scheduler's (float32) alphas_cumprod: near t = 0 the differences
    1 - a and 1 - a_prev - sigma^2 are ~1e-3 and lose digits in float32."""
    if eta <= 0:
        raise ValueError(
            f"eta must be > 0 for a stochastic DDIM step with a log-probability (eta=0 is deterministic "
            f"DDIM and its log-density is undefined); got eta={eta}"
        )
    if scheduler.num_inference_steps is None:
        raise ValueError("call scheduler.set_timesteps(num_steps) before stepping")
    t_in = torch.as_tensor(timestep)
    t = t_in.long().reshape(-1).cpu()  # float64 on CPU (some accelerators lack float64); [B] scalars only
    acp = scheduler.alphas_cumprod.to(device="cpu", dtype=torch.float64)
    num_train = scheduler.config.num_train_timesteps
    t_prev = (t - num_train // scheduler.num_inference_steps).clamp(0, num_train - 1)
    alpha_t, alpha_prev = acp[t], acp[t_prev]
    variance = (1 - alpha_prev) / (1 - alpha_t) * (1 - alpha_t / alpha_prev)
    std = eta * variance.sqrt()
    eps_coef = (1 - alpha_prev - std**2).clamp(min=0).sqrt()
    coef = {"alpha_prod_t": alpha_t, "alpha_prod_prev": alpha_prev, "std": std, "eps_coef": eps_coef}
    return {k: v.to(t_in.device) for k, v in coef.items()}


def ddim_step_mean(
    scheduler,
    model_output: Tensor,
    timestep: Tensor | int,
    sample: Tensor,
    eta: float = 1.0,
    coefficients: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The Gaussian of one DDIM step: (mu [B, C, H, W] float32, sigma_t [B, 1, 1, 1] float32), formulas
    (12) and (16) of the DDIM paper (module docstring); arguments as ``ddim_step_with_logprob``.
    Differentiable in ``model_output``; sigma_t does not depend on the model."""
    batch = sample.shape[0]
    t = _as_batched_timesteps(timestep, batch, sample.device)
    coef = ddim_step_coefficients(scheduler, t, eta) if coefficients is None else coefficients
    view = (batch,) + (1,) * (sample.dim() - 1)
    coef = {k: v.to(torch.float32).view(view) for k, v in coef.items()}  # on sample.device, like t
    alpha_t, alpha_prev, std, eps_coef = (coef[k] for k in ("alpha_prod_t", "alpha_prod_prev", "std", "eps_coef"))

    x_t = sample.float()
    out = model_output.float()
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        x0_hat = (x_t - (1 - alpha_t).sqrt() * out) / alpha_t.sqrt()
        eps_hat = out
    elif kind == "v_prediction":
        x0_hat = alpha_t.sqrt() * x_t - (1 - alpha_t).sqrt() * out
        eps_hat = alpha_t.sqrt() * out + (1 - alpha_t).sqrt() * x_t
    elif kind == "sample":
        x0_hat = out
        eps_hat = (x_t - alpha_t.sqrt() * x0_hat) / (1 - alpha_t).sqrt()
    else:
        raise ValueError(f"unsupported prediction_type {kind!r} (epsilon, v_prediction or sample)")

    if scheduler.config.thresholding:
        x0_hat = scheduler._threshold_sample(x0_hat)
    elif scheduler.config.clip_sample:
        limit = scheduler.config.clip_sample_range
        x0_hat = x0_hat.clamp(-limit, limit)

    return alpha_prev.sqrt() * x0_hat + eps_coef * eps_hat, std


def ddim_step_with_logprob(
    scheduler,
    model_output: Tensor,
    timestep: Tensor | int,
    sample: Tensor,
    eta: float = 1.0,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
    coefficients: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """DDIM step with log-probability (see the module docstring for the math and its origin).

    Args:
        scheduler: a ``diffusers.DDIMScheduler`` after ``set_timesteps(N)``.
        model_output: [B, C, H, W] the (guided) UNet output; epsilon, v or sample per
            ``scheduler.config.prediction_type``.
        timestep: int or long tensor [B], the current t.
        sample: [B, C, H, W] x_t.
        eta: > 0, scale of sigma_t (1 = DDPM posterior variance).
        prev_sample: [B, C, H, W] the recorded x_{t'} to score; when None it is drawn as mu + sigma_t z
            with z from ``generator``.
        coefficients: ``ddim_step_coefficients(scheduler, timestep, eta)`` computed beforehand (each [B],
            on ``sample.device``): a sampler computes them once for every step, which avoids one
            host round trip (a device sync on GPU) per step.
    Returns:
        (prev_sample [B, C, H, W] in ``sample``'s dtype, log_prob [B] float32: the Gaussian
        log-density of prev_sample (detached) under N(mu, sigma_t^2 I), averaged over C,H,W).
    """
    mean, std = ddim_step_mean(scheduler, model_output, timestep, sample, eta, coefficients)

    if prev_sample is None:
        from diffusers.utils.torch_utils import randn_tensor

        noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device,
                             dtype=model_output.dtype)
        # rounded to the sample dtype *before* scoring, so the recorded latent and the recorded
        # log-prob agree exactly (ddpo scores the float value and rounds afterwards)
        prev_sample = (mean + std * noise.float()).to(sample.dtype)
    log_prob = gaussian_logprob_mean(prev_sample.detach().float(), mean, std)
    return prev_sample.to(sample.dtype), log_prob
