"""Step kernels: how a denoising policy turns its denoiser into trajectories and log-probs.

A ``DenoiserPolicy`` is composed of a **family adapter** (``policy.family``: prompt encoding, the denoiser call
with its guidance, the latent geometry, the stock pipeline), the policy's shared code (initial noise, forward
noising and the regression target, decode) and one **step kernel** (this module), held as ``policy.kernel`` and
named by the family (``ImageFamily.kernel``, a key of ``KERNELS``):

    GaussianStepKernel   the N steps x_T -> x_0 of a stochastic sampler whose every step is a Gaussian with a
                         theta-independent std; a trajectory's steps are its transitions, ``logp_B_T`` their
                         log-densities (mean over C,H,W), the closed-form step KL beside them
      DDIMKernel         DDIM with eta > 0 (DDPO, Black et al. 2023; ``unialign.image.ddim``)
      FlowSDEKernel      Flow-GRPO's SDE / CPS step with an optional stochastic window (``unialign.image.flow``)

A kernel asks the policy only for: ``device``, ``scheduler``, ``num_steps``, ``_cfg``, ``cond_keys``,
``_sampling_cond(prompts)``, ``_initial_latents(batch, generator)``, ``_denoise(model, x, t_B, cond, cfg)`` and
``decode(latents)``; so a kernel is tested alone on a stand-in policy (tests/image/test_kernels.py) and a new
kernel never touches a family.
"""

from __future__ import annotations

from typing import Any

import torch

from unialign.algos.kl import gaussian_kl
from unialign.image.ddim import (
    HALF_LOG_2PI,
    ddim_step_coefficients,
    ddim_step_mean,
    ddim_step_with_logprob,
    gaussian_logprob_mean,
)
from unialign.image.flow import (
    check_noise_level,
    flow_step_coefficients,
    flow_step_kl,
    sde_step_with_logprob,
    sde_window_bounds,
)
from unialign.types import Trajectory

Tensor = torch.Tensor


def check_terms(kernel: Any, names: tuple[str, ...]) -> None:
    """ValueError naming the loss terms ``names`` asks of ``kernel`` that it does not offer (``offered_terms``)."""
    unknown = sorted(set(names) - set(kernel.offered_terms))
    if unknown:
        raise ValueError(f"the {type(kernel).__name__} offers no loss terms {unknown} (it offers "
                         f"{list(kernel.offered_terms)})")


class GaussianStepKernel:
    """The shared part of the Gaussian-step kernels: the sampling loop with per-step log-prob recording and the
    recomputed log-probs (with entropy and the closed-form KL) of the trained steps. A subclass gives the steps:

        window(generator)                                [start, end) of the stochastic steps
        plan(policy)                                     every step's coefficients (opaque here)
        transition(policy, i, out, t_B, x, generator, plan, stochastic) -> (x', logp_B, mean or None)
        trained_mask(policy, batch, generator, window, plan) -> mask_B_T
        step_logprob(policy, out, t_R, x_R, next_R) -> (logp_R, mean, std) of recorded steps
        step_std(policy, timesteps_B_T)                  the step Gaussian's std [B, N] (entropy)
        step_kl(mean, ref_mean, std)                     the closed-form KL [R]

    Extra loss terms (``terms``; ``offered_terms`` names them, ``prepare_terms`` asks for them before sampling):
    ``"step_gauss"`` -- (mean [B, N, C, H, W] of the trained steps under the current weights, differentiable; the
    sampling policy's means, recorded at sampling; the step std [B, N]; the step's dt [B, N]), what GRPO-Guard's
    RatioNorm and Flow-DPPO's trust region read (``unialign.algos.flow_trust``); a kernel with ``step_dt``.
    """

    estimator = "sampler"  # the log-prob is the sampler's own step density
    closed_form_kls: tuple[str, ...] = ("gaussian",)
    offered_terms: tuple[str, ...] = ()
    record_means = False  # set by prepare_terms("step_gauss"): the sampler keeps every step's mean

    def prepare_terms(self, names: tuple[str, ...]) -> None:
        """Record at sampling what the loss terms ``names`` read (ValueError for a term the kernel lacks)."""
        check_terms(self, names)
        self.record_means = "step_gauss" in names

    def sample(self, policy: Any, model: torch.nn.Module, prompts: list[Any], generator: torch.Generator | None,
               record_logp: bool = True) -> Trajectory:
        """The N steps from x_T to x_0 with ``model`` (the policy's or the reference's). The log-probs come free
        with each step (``record_logp`` is ignored). The generator is drawn in this order: x_T, the stochastic
        window, each step's noise, the trained-steps mask."""
        return self._sample(policy, model, prompts, generator)

    def _sample(self, policy: Any, model: torch.nn.Module, prompts: list[Any],
                generator: torch.Generator | None) -> Trajectory:
        batch = len(prompts)
        cond = policy._sampling_cond(prompts)
        latents = policy._initial_latents(batch, generator)
        start, end = self.window(generator)
        timesteps = policy.scheduler.timesteps.to(policy.device)
        plan = self.plan(policy)
        all_latents, all_logps, all_means = [latents], [], []
        for i, t in enumerate(timesteps):
            t_B = t.expand(batch)
            out = policy._denoise(model, latents, t_B, cond, policy._cfg)
            x, logp, mean = self.transition(policy, i, out, t_B, latents, generator, plan, start <= i < end)
            if self.record_means:  # a deterministic step's mean is never read (it is not trained): zeros
                all_means.append(mean.float() if mean is not None else torch.zeros_like(latents, dtype=torch.float32))
            latents = x
            all_latents.append(latents)
            all_logps.append(logp)
        payload = {"latents": torch.stack(all_latents, dim=1), "timesteps": timesteps.expand(batch, -1).clone(), **cond}
        if self.record_means:
            payload["means"] = torch.stack(all_means, dim=1)
        return Trajectory(prompts=list(prompts), completions=policy.decode(latents),
                          mask_B_T=self.trained_mask(policy, batch, generator, (start, end), plan),
                          old_logp_B_T=torch.stack(all_logps, dim=1),
                          truncated_B=torch.zeros(batch, dtype=torch.bool, device=policy.device), payload=payload)

    def log_prob(self, policy: Any, model: torch.nn.Module, trajectory: Trajectory, with_entropy: bool,
                 reference: Any = None) -> Any:
        """``logp_B_T`` (with ``with_entropy``: and ``entropy_B_T``; with a ``reference``: and the closed-form
        ``kl_B_T`` to it) of the trained steps. Every trained (sample, step) pair of the batch in ONE model call
        (each row its own x_t, t and conditioning): a micro-batch's trained steps are scattered over the N
        columns, and a call per column runs the model on a few rows at a time."""
        logp_B_T, kl_B_T, _ = self._evaluate(policy, model, trajectory, reference)
        if not with_entropy:
            return logp_B_T
        entropy_B_T = self._entropy(policy, trajectory)
        if reference is None:
            return logp_B_T, entropy_B_T
        return logp_B_T, entropy_B_T, kl_B_T

    def terms(self, policy: Any, model: torch.nn.Module, trajectory: Trajectory, names: tuple[str, ...],
              reference: Any = None) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Any]]:
        """(logp, entropy, kl or None, {name: ...}) in one model call (the class docstring's terms)."""
        check_terms(self, names)
        logp_B_T, kl_B_T, rows = self._evaluate(policy, model, trajectory, reference)
        extra: dict[str, Any] = {}
        if "step_gauss" in names:
            payload = trajectory.payload
            if "means" not in payload:
                raise ValueError("the 'step_gauss' term reads the sampling policy's step means, which this trajectory "
                                 "lacks (prepare_terms(('step_gauss',)) before sampling)")
            old = payload["means"].to(logp_B_T.device).float()
            mean = torch.zeros_like(old)
            if rows is not None:
                (r, c), mean_R = rows
                mean = mean.index_put((r, c), mean_R.float())
            timesteps = payload["timesteps"]
            extra["step_gauss"] = (mean, old, self.step_std(policy, timesteps).to(logp_B_T.device),
                                   self.step_dt(policy, timesteps).to(logp_B_T.device))
        return logp_B_T, self._entropy(policy, trajectory), (kl_B_T if reference is not None else None), extra

    def _evaluate(self, policy: Any, model: torch.nn.Module, trajectory: Trajectory, reference: Any = None):
        """(logp_B_T, kl_B_T, ((rows, cols), mean_R) or None): the trained steps' log-probs in one model call, the
        closed-form KL to a ``reference`` (zeros without one), and the trained steps' means (differentiable)."""
        payload = trajectory.payload
        latents, timesteps = payload["latents"], payload["timesteps"]
        mask = trajectory.mask_B_T.to(latents.device)
        batch, steps = timesteps.shape
        logp_B_T = torch.zeros(batch, steps, device=latents.device, dtype=torch.float32)
        kl_B_T = torch.zeros_like(logp_B_T)
        rows, cols = (mask > 0).nonzero(as_tuple=True)
        if rows.numel() == 0:
            return logp_B_T, kl_B_T, None
        t_R, x_R, next_R = timesteps[rows, cols], latents[rows, cols], latents[rows, cols + 1]
        cond = {k: payload[k][rows] for k in policy.cond_keys}
        out = policy._denoise(model, x_R, t_R, cond, policy._cfg)
        logp, mean, std = self.step_logprob(policy, out, t_R, x_R, next_R)
        logp_B_T = logp_B_T.index_put((rows, cols), logp)
        if reference is not None:
            with reference._frozen():
                ref_out = policy._denoise(reference.model, x_R, t_R, cond, policy._cfg)
                ref_mean = self.step_logprob(policy, ref_out, t_R, x_R, next_R)[1]
            kl_B_T = kl_B_T.index_put((rows, cols), self.step_kl(mean, ref_mean, std))
        return logp_B_T, kl_B_T, ((rows, cols), mean)

    def _entropy(self, policy: Any, trajectory: Trajectory) -> Tensor:
        """0.5 log(2 pi e std^2) of each trained step [B, N] (0 where masked or deterministic)."""
        timesteps = trajectory.payload["timesteps"]
        mask = trajectory.mask_B_T.to(timesteps.device)
        std_B_T = self.step_std(policy, timesteps).to(timesteps.device)
        live = (mask > 0) & (std_B_T > 0)
        return torch.where(live, 0.5 + HALF_LOG_2PI + torch.log(std_B_T.clamp(min=1e-30)),
                           torch.zeros_like(std_B_T))

    def step_kl(self, mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
        """KL(N(mean, std^2) || N(ref_mean, std^2)) per row, mean over the other dims [R]."""
        return gaussian_kl(mean, ref_mean, std)


class DDIMKernel(GaussianStepKernel):
    """The DDIM step with eta > 0 on the policy's ``DDIMScheduler`` (``unialign.image.ddim``): every step is
    stochastic; K = max(1, int(M x ``timestep_fraction``)) of the M trainable steps (those whose std is at least
    ``min_step_std``) are trained per sample, chosen by an independent random permutation (ddpo-pytorch)."""

    name = "ddim"
    knobs = ("eta", "timestep_fraction", "min_step_std")  # the SamplerKnobs fields it reads
    solvers = ("ddim", "dpmpp")  # the deterministic solvers ForwardKernel collects with on this schedule

    @staticmethod
    def check_knobs(knobs) -> None:
        """What a config's ``SamplerKnobs`` must satisfy, checked before any model loads (ValueError naming the
        field)."""
        if not knobs.eta > 0:
            raise ValueError(f"eta: must be > 0 for DDIM (the step log-probability needs sigma_t > 0), got {knobs.eta}")

    def __init__(self, scheduler, num_steps: int, eta: float, timestep_fraction: float = 1.0,
                 min_step_std: float = 0.0) -> None:
        if eta <= 0:
            raise ValueError(f"eta must be > 0 (the step log-probability needs sigma_t > 0), got {eta}")
        if not 0.0 < timestep_fraction <= 1.0:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
        self.num_steps, self.eta, self.timestep_fraction = num_steps, eta, timestep_fraction
        step_std = ddim_step_coefficients(scheduler, scheduler.timesteps, eta)["std"]
        self.trainable_steps = torch.nonzero(step_std >= min_step_std).flatten()
        if self.trainable_steps.numel() == 0:
            raise ValueError(f"min_step_std={min_step_std} leaves no trainable step (the largest sigma_t of "
                             f"{num_steps} steps at eta {eta} is {float(step_std.max()):.3g})")

    def window(self, generator: torch.Generator | None) -> tuple[int, int]:
        return 0, self.num_steps  # every DDIM step (eta > 0) is stochastic; which are trained: trained_mask

    def plan(self, policy: Any) -> dict[str, Tensor]:
        # every step's coefficients at once (float64 on the host, then one copy): no host sync per step
        coefs = ddim_step_coefficients(policy.scheduler, policy.scheduler.timesteps, self.eta)
        return {k: v.to(policy.device) for k, v in coefs.items()}

    def transition(self, policy: Any, i: int, out: Tensor, t_B: Tensor, latents: Tensor,
                   generator: torch.Generator | None, plan: dict[str, Tensor], stochastic: bool) -> tuple[Tensor, Tensor]:
        batch = latents.shape[0]
        x, logp = ddim_step_with_logprob(policy.scheduler, out, t_B, latents, eta=self.eta, generator=generator,
                                         coefficients={k: v[i].expand(batch) for k, v in plan.items()})
        return x, logp, None

    def trained_mask(self, policy: Any, batch: int, generator: torch.Generator | None, window: tuple[int, int],
                     plan: dict[str, Tensor]) -> Tensor:
        return self.trained_steps_mask(batch, generator).to(policy.device)

    def trained_steps_mask(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """mask_B_T: K = max(1, int(M * timestep_fraction)) of the M trainable steps per sample, chosen by an
        independent random permutation per sample (as ddpo-pytorch, which has M = N)."""
        n, steps = self.num_steps, self.trainable_steps
        k = max(1, int(len(steps) * self.timestep_fraction))
        mask = torch.zeros(batch, n)
        if k == len(steps):
            mask[:, steps] = 1.0
            return mask
        gen_device = generator.device if generator is not None else "cpu"
        for i in range(batch):
            mask[i, steps[torch.randperm(len(steps), generator=generator, device=gen_device)[:k].cpu()]] = 1.0
        return mask

    def step_logprob(self, policy: Any, out: Tensor, t_R: Tensor, x_R: Tensor,
                     next_R: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mean, std = ddim_step_mean(policy.scheduler, out, t_R, x_R, self.eta)
        return gaussian_logprob_mean(next_R.detach().float(), mean, std), mean, std

    def step_std(self, policy: Any, timesteps_B_T: Tensor) -> Tensor:
        return ddim_step_coefficients(policy.scheduler, timesteps_B_T.reshape(-1), self.eta)["std"].view(
            timesteps_B_T.shape)


class FlowSDEKernel(GaussianStepKernel):
    """Flow-GRPO's stochastic step (``sde_type`` "sde" or "cps", noise level eta) on the policy's
    ``FlowMatchEulerDiscreteScheduler``; with ``sde_window_size`` k > 0 only a window of k consecutive steps per
    sampling call is stochastic and trained (Flow-GRPO-Fast), the others deterministic Euler steps. A step of std
    0 (the last "cps" step) is never trained."""

    closed_form_kls = ("gaussian", "gaussian_g2")
    offered_terms = ("step_gauss",)
    name = "flow_sde"
    knobs = ("noise_level", "sde_type", "sde_window_size", "sde_window_range")  # the SamplerKnobs fields it reads
    solvers = ("euler",)  # the deterministic solver ForwardKernel collects with on this schedule

    @staticmethod
    def check_knobs(knobs) -> None:
        """What a config's ``SamplerKnobs`` must satisfy, checked before any model loads (ValueError naming the
        field)."""
        check_noise_level(knobs.sde_type, knobs.noise_level)
        sde_window_bounds(knobs.num_steps, knobs.sde_window_size, knobs.sde_window_range)

    def __init__(self, num_steps: int, noise_level: float, sde_type: str, sde_window_size: int = 0,
                 sde_window_range: tuple[int, int] | None = None) -> None:
        check_noise_level(sde_type, noise_level)
        lo, hi = sde_window_bounds(num_steps, sde_window_size, sde_window_range)
        self.num_steps, self.noise_level, self.sde_type = num_steps, noise_level, sde_type
        self.sde_window_size, self.sde_window_range = sde_window_size, (lo, hi)

    def window(self, generator: torch.Generator | None = None) -> tuple[int, int]:
        """[start, end) of the stochastic, trained steps: all N without a window; else a window of
        ``sde_window_size`` steps starting uniformly in [lo, hi - size] (one draw from ``generator``)."""
        if self.sde_window_size == 0:
            return 0, self.num_steps
        lo, hi = self.sde_window_range
        device = generator.device if generator is not None else "cpu"
        start = lo + int(torch.randint(0, hi - self.sde_window_size - lo + 1, (1,), generator=generator,
                                       device=device).item())
        return start, start + self.sde_window_size

    def plan(self, policy: Any) -> tuple[dict[str, Tensor], Tensor]:
        coefs = flow_step_coefficients(policy.scheduler, policy.scheduler.timesteps, self.num_steps, self.noise_level,
                                       self.sde_type)
        return coefs, policy.scheduler.sigmas.to(policy.device, torch.float32)

    def transition(self, policy: Any, i: int, out: Tensor, t_B: Tensor, latents: Tensor,
                   generator: torch.Generator | None, plan: tuple[dict[str, Tensor], Tensor],
                   stochastic: bool) -> tuple[Tensor, Tensor]:
        coefs, sigmas = plan
        v, batch = out.float(), latents.shape[0]
        if stochastic:
            latents, logp, mean, _ = sde_step_with_logprob(
                policy.scheduler, v, t_B, latents, self.noise_level, generator=generator, sde_type=self.sde_type,
                coefficients={k: c[i].expand(batch) for k, c in coefs.items()})
            return latents, logp, mean
        # a deterministic Euler step (FlowMatchEulerDiscreteScheduler.step), not trained
        return latents + (sigmas[i + 1] - sigmas[i]) * v, torch.zeros(batch, device=policy.device), None

    def trained_mask(self, policy: Any, batch: int, generator: torch.Generator | None, window: tuple[int, int],
                     plan: tuple[dict[str, Tensor], Tensor]) -> Tensor:
        start, end = window
        mask = torch.zeros(batch, self.num_steps, device=policy.device)
        mask[:, start:end] = 1.0
        # a step of std 0 (the last "cps" step, sigma' = 0) is deterministic: no Gaussian to train or to take
        # a KL of (Flow-GRPO trains int(0.99 N) steps, never the last)
        mask[:, plan[0]["std"].to(policy.device) <= 0] = 0.0
        return mask

    def step_logprob(self, policy: Any, out: Tensor, t_R: Tensor, x_R: Tensor,
                     next_R: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _, logp, mean, std = sde_step_with_logprob(policy.scheduler, out, t_R, x_R, self.noise_level,
                                                   prev_sample=next_R, sde_type=self.sde_type)
        return logp, mean, std

    def step_std(self, policy: Any, timesteps_B_T: Tensor) -> Tensor:
        std = flow_step_coefficients(policy.scheduler, timesteps_B_T.reshape(-1).cpu(), timesteps_B_T.numel(),
                                     self.noise_level, self.sde_type)["std"]
        return std.view(timesteps_B_T.shape).to(torch.float32)

    def step_dt(self, policy: Any, timesteps_B_T: Tensor) -> Tensor:
        """Each step's dt = sigma' - sigma [B, N] (< 0: from noise to data)."""
        dt = flow_step_coefficients(policy.scheduler, timesteps_B_T.reshape(-1).cpu(), timesteps_B_T.numel(),
                                    self.noise_level, self.sde_type)["dt"]
        return dt.view(timesteps_B_T.shape).to(torch.float32)

    def step_kl(self, mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
        return flow_step_kl(mean, ref_mean, std)  # refuses a step of std 0

    def kl_weights(self, policy: Any, trajectory: Trajectory) -> Tensor:
        """[B, T] std^2 / g^2 of each step: the factor from the exact step KL to Flow-GRPO's, which divides the
        squared mean gap by the diffusion coefficient g^2 (``kl_estimator="gaussian_g2"``): |dt| for the SDE step
        (std = g sqrt(|dt|)), 1 for CPS (its KL divides by the step's own std^2)."""
        timesteps = trajectory.payload["timesteps"]
        if self.sde_type == "cps":
            return torch.ones(timesteps.shape, dtype=torch.float32)
        dt = flow_step_coefficients(policy.scheduler, timesteps.reshape(-1).cpu(), timesteps.numel(),
                                    self.noise_level, self.sde_type)["dt"]
        return dt.abs().view(timesteps.shape).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# The forward process: any sampler, then the model's own matching loss at fresh noise
# ---------------------------------------------------------------------------------------------
SAMPLERS = ("auto", "euler", "ddim", "dpmpp")
TIME_SAMPLING = ("stratified", "random")


class ForwardKernel:
    """Forward-process trajectories (AWM, DiffusionNFT): a sample's steps are K training pairs (t, eps) at which
    the denoiser's own pre-training loss is evaluated, not the transitions of a sampler.

    Collection: the N steps of a **deterministic** solver with the policy's schedule and guidance (``sampler``:
    "auto" = Euler for flow matching, DDIM eta 0 for UNets; "dpmpp" = diffusers' DPM-Solver++ 2M for UNets),
    no log-density recorded; only the clean latent x0, the condition and the K pairs are kept. The K times are
    step indices of the solver's schedule within the first ``timestep_fraction`` of it: "stratified" (AWM's
    ``discrete_wo_init``: K strata of [1, int(N f)), one index drawn in each, per sample; AWM draws one set per
    micro-batch) or "random" (DiffusionNFT: a random K of the N indices without replacement, per sample); eps is
    fresh per pair.

    ``log_prob``: the weighted matching log-prob of every pair ``unialign.algos.forward.matching_logprob`` at
    x_t = alpha x0 + sigma eps (the policy's ``_forward_process``: rectified flow's (1 - sigma) x0 + sigma eps with
    target eps - x0; a UNet's scheduler with target eps / v / x0 by its ``prediction_type``), the weighting's time
    being the noise level sigma; no CFG in training (both papers train CFG-free). Its closed-form KL to the
    reference, ``prediction_mse``, is mean_D (pred - pred_ref)^2 (AWM's and NFT's "uniform" velocity KL).
    ``terms(..., "nft")``: what DiffusionNFT's loss reads, the old prediction from the policy's old (moving-average)
    weights. ``sample_old``: collect with the old weights (DiffusionNFT)."""

    estimator = "forward"  # the log-prob is the forward-process matching surrogate
    closed_form_kls = ("prediction_mse",)
    offered_terms = ("nft", "dgpo", "old_mse")

    def __init__(self, num_steps: int, train_timesteps: int = 6, timestep_fraction: float = 0.9,
                 time_sampling: str = "stratified", weighting: str = "ghuber", power: float = 0.25,
                 sampler: str = "auto", sample_old: bool = False, share_pairs: bool = False) -> None:
        from unialign.algos.forward import WEIGHTINGS

        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if time_sampling not in TIME_SAMPLING:
            raise ValueError(f"time_sampling must be one of {TIME_SAMPLING}, got {time_sampling!r}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if not 0.0 < timestep_fraction <= 1.0:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
        span = self._span(num_steps, timestep_fraction, time_sampling)
        if not 1 <= train_timesteps <= span:
            raise ValueError(f"train_timesteps must be in [1, {span}] for {num_steps} steps at timestep_fraction "
                             f"{timestep_fraction} ({time_sampling}), got {train_timesteps}")
        self.num_steps, self.train_timesteps, self.timestep_fraction = num_steps, train_timesteps, timestep_fraction
        self.time_sampling, self.weighting, self.power, self.sampler = time_sampling, weighting, power, sampler
        self.sample_old, self.share_pairs = sample_old, share_pairs

    def prepare_terms(self, names: tuple[str, ...]) -> None:
        """Nothing is recorded at sampling for the forward kernel's terms; ValueError for a term it lacks."""
        check_terms(self, names)

    @staticmethod
    def _span(num_steps: int, fraction: float, time_sampling: str) -> int:
        """How many distinct step indices the K times may take: [1, int(N f)) stratified, int(N f) random."""
        top = int(num_steps * fraction)
        return top - 1 if time_sampling == "stratified" else max(top, 1)

    # ------------------------------------------------------------------ collection
    @staticmethod
    def _solver_kind(sampler: str, step_kernel: str) -> str:
        """The solver ``sampler`` names for a family whose step kernel is ``step_kernel`` (a ``KERNELS`` key: its
        ``solvers``, the first for "auto"); ValueError when that schedule has no such solver."""
        solvers = KERNELS[step_kernel].solvers
        kind = sampler if sampler != "auto" else solvers[0]
        if kind not in solvers:
            raise ValueError(f"{kind!r}: a family on the {step_kernel!r} step kernel collects with "
                             f"{' or '.join(map(repr, solvers))} (or 'auto')")
        return kind

    def _solver(self, policy: Any):
        """(kind, scheduler) of the collection sampler for ``policy``."""
        kind = self._solver_kind(self.sampler, policy.family.kernel)
        if kind == "dpmpp":
            from diffusers import DPMSolverMultistepScheduler

            solver = DPMSolverMultistepScheduler.from_config(policy.scheduler.config, algorithm_type="dpmsolver++",
                                                             solver_order=2)
            solver.set_timesteps(self.num_steps, device=policy.device)
            return kind, solver
        return kind, policy.scheduler

    def schedule(self, policy: Any) -> Tensor:
        """The collection sampler's N timesteps (the model's time input at each step)."""
        return self._solver(policy)[1].timesteps

    @torch.no_grad()
    def sample(self, policy: Any, model: torch.nn.Module, prompts: list[Any], generator: torch.Generator | None,
               record_logp: bool = True) -> Trajectory:
        """x_T -> x0 with the deterministic solver (the old weights with ``sample_old``), then K (t, eps) pairs
        per sample. The generator is drawn in this order: x_T, one seed for the pairs' own generator (their step
        indices, then their noise; with no generator both come from torch's global one).
        ``record_logp``: the sampling policy's log-probs of the pairs (one more forward); False leaves them None
        (a batch with one optimizer step: the trainer takes the first forward's, detached)."""
        import contextlib

        batch = len(prompts)
        cond = policy._sampling_cond(prompts)
        kind, solver = self._solver(policy)
        old = policy._old_weights() if self.sample_old else contextlib.nullcontext()
        with old:
            x = policy._initial_latents(batch, generator)
            timesteps = solver.timesteps.to(policy.device)
            sigmas = solver.sigmas.to(policy.device, torch.float32) if kind == "euler" else None
            for i, t in enumerate(timesteps):
                out = policy._denoise(model, x, t.expand(batch), cond, policy._cfg)
                if kind == "euler":
                    x = x + (sigmas[i + 1] - sigmas[i]) * out.float()
                elif kind == "ddim":
                    x = solver.step(out, t, x, eta=0.0).prev_sample
                else:
                    x = solver.step(out, t, x).prev_sample
        x0 = x.float()
        # the pairs from a generator of their own seeded by ONE draw: a chunked evaluation's next x_T is the same
        # whatever K or the time sampling (so AWM and NFT runs evaluate on the same noise)
        pairs = None if generator is None else torch.Generator().manual_seed(
            int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)))
        idx = self._draw_indices(batch, pairs)
        noise = torch.randn((batch, self.train_timesteps, *x0.shape[1:]), generator=pairs, dtype=torch.float32)
        if self.share_pairs:  # DGPO: one set of K (t, eps) per prompt of this call, shared by its group (its first
            # sample's); a sampling chunk holds whole groups (unialign.recipes.image.forward_process_kwargs checks)
            first: dict[str, int] = {}
            src = torch.tensor([first.setdefault(str(p), i) for i, p in enumerate(prompts)])
            idx, noise = idx[src], noise[src]
        noise = noise.to(policy.device)
        payload = {"x0": x0, "timesteps": timesteps[idx.to(timesteps.device)].to(policy.device), "noise": noise,
                   **cond}
        traj = Trajectory(prompts=list(prompts), completions=policy.decode(x0),
                          mask_B_T=torch.ones(batch, self.train_timesteps, device=policy.device), old_logp_B_T=None,
                          truncated_B=torch.zeros(batch, dtype=torch.bool, device=policy.device), payload=payload)
        if record_logp:
            traj.old_logp_B_T = self.log_prob(policy, model, traj, False)
        return traj

    def _draw_indices(self, batch: int, generator: torch.Generator | None) -> Tensor:
        """[B, K] step indices of the solver's schedule (class docstring), long."""
        k, top = self.train_timesteps, int(self.num_steps * self.timestep_fraction)
        if self.time_sampling == "random":
            return torch.stack([torch.randperm(max(top, 1), generator=generator)[:k] for _ in range(batch)])
        bounds = torch.linspace(1, top, k + 1).long()  # AWM: linspace(1, int(N f), K + 1), strata [lo, hi)
        lo, hi = bounds[:-1], bounds[1:]
        u = torch.rand(batch, k, generator=generator)
        return lo + (u * (hi - lo)).long()

    # ------------------------------------------------------------------ training
    def _pairs(self, policy: Any, trajectory: Trajectory) -> dict[str, Any] | None:
        """The trained pairs of ``trajectory`` (its mask) as rows: indices, forward-process values (x_t, target,
        alpha, sigma) and condition, for one model call over all of them. None when no pair is trained."""
        payload, mask = trajectory.payload, trajectory.mask_B_T
        rows, cols = (mask.to(payload["x0"].device) > 0).nonzero(as_tuple=True)
        if rows.numel() == 0:
            return None
        x0, eps, t = payload["x0"][rows], payload["noise"][rows, cols], payload["timesteps"][rows, cols]
        fp = policy._forward_process(x0, eps, t)
        cond = {k: payload[k][rows] for k in policy.cond_keys}
        return {"rows": rows, "cols": cols, "x0": x0, "t": t, "cond": cond, **fp}

    def _scatter(self, trajectory: Trajectory, rows: Tensor, cols: Tensor, values: Tensor) -> Tensor:
        out = torch.zeros(trajectory.mask_B_T.shape, device=values.device, dtype=torch.float32)
        return out.index_put((rows.to(values.device), cols.to(values.device)), values.float())

    def log_prob(self, policy: Any, model: torch.nn.Module, trajectory: Trajectory, with_entropy: bool,
                 reference: Any = None) -> Any:
        """``logp_B_K`` (class docstring); with ``with_entropy`` and zeros for the entropy (no step Gaussian);
        with a ``reference`` also ``kl_B_K`` = mean_D (pred - pred_ref)^2, differentiable through pred."""
        logp, kl, _ = self._evaluate(policy, model, trajectory, reference, ())
        if not with_entropy:
            return logp
        entropy = torch.zeros_like(logp)
        return (logp, entropy) if reference is None else (logp, entropy, kl)

    def terms(self, policy: Any, model: torch.nn.Module, trajectory: Trajectory, names: tuple[str, ...],
              reference: Any = None) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Any]]:
        """(logp, entropy, kl or None, {name: ...}) in one model call; ``"nft"``: (old_err [B, K, C, H, W], delta
        [B, K, C, H, W]), the old weights' clean-image error x0_old - x0 and x0_theta - x0_old (differentiable), what
        ``unialign.algos.forward.nft_loss_terms`` reads (0 at untrained pairs); ``"dgpo"``: (ref_logp [B, K], old_logp
        [B, K]), the reference's (``policy.reference()``) and the old weights' matching log-probs at the same pairs,
        no gradient, what ``unialign.algos.forward.dgpo_loss`` reads as -ref_err and -old_err; ``"old_mse"``: mean_D
        (pred - pred_old)^2 [B, K], differentiable through pred (AWM's trust term to its moving average)."""
        logp, kl, extra = self._evaluate(policy, model, trajectory, reference, names)
        return logp, torch.zeros_like(logp), (kl if reference is not None else None), extra

    def _evaluate(self, policy, model, trajectory, reference, names):
        from unialign.algos.forward import matching_logprob

        check_terms(self, names)
        p = self._pairs(policy, trajectory)
        zeros = torch.zeros(trajectory.mask_B_T.shape, device=policy.device, dtype=torch.float32)
        if p is None:
            return zeros, zeros, {name: (zeros, zeros) for name in names}
        old = None
        if names and policy.has_old_policy:  # before the differentiable call: the old weights are swapped in
            with torch.no_grad(), policy._old_weights():
                old = policy._denoise(model, p["x_t"], p["t"], p["cond"], False).float()
        p["pred"] = policy._denoise(model, p["x_t"], p["t"], p["cond"], False).float()
        if names and old is None:  # no old policy: the old weights are the current ones, no second pass
            old = p["pred"].detach()

        def logp_of(pred: Tensor) -> Tensor:
            return matching_logprob(pred, p["target"], p["sigma"], self.weighting, self.power)

        logp = logp_of(p["pred"])
        rows, cols = p["rows"], p["cols"]
        kl, ref = zeros, None
        if reference is not None or "dgpo" in names:
            frozen = reference if reference is not None else policy.reference()
            with frozen._frozen():
                ref = policy._denoise(frozen.model, p["x_t"], p["t"], p["cond"], False).float()
        if reference is not None:
            d = (p["pred"] - ref) ** 2
            kl = self._scatter(trajectory, rows, cols, d.reshape(d.shape[0], -1).mean(1))
        extra = {}
        if "dgpo" in names:
            extra["dgpo"] = (self._scatter(trajectory, rows, cols, logp_of(ref)),
                             self._scatter(trajectory, rows, cols, logp_of(old)))
        if "old_mse" in names:
            d = (p["pred"] - old) ** 2
            extra["old_mse"] = self._scatter(trajectory, rows, cols, d.reshape(d.shape[0], -1).mean(1))
        if "nft" in names:
            x0_old = policy._x0_from(old, p)
            extra["nft"] = (self._scatter_D(trajectory, rows, cols, x0_old - p["x0"].float()),
                            self._scatter_D(trajectory, rows, cols, policy._x0_from(p["pred"], p) - x0_old))
        return self._scatter(trajectory, rows, cols, logp), kl, extra

    def _scatter_D(self, trajectory: Trajectory, rows: Tensor, cols: Tensor, values_R_D: Tensor) -> Tensor:
        b, k = trajectory.mask_B_T.shape
        out = torch.zeros((b, k, *values_R_D.shape[1:]), device=values_R_D.device, dtype=torch.float32)
        return out.index_put((rows.to(values_R_D.device), cols.to(values_R_D.device)), values_R_D.float())


# the step kernels by name: what a family's ``kernel`` attribute names (``unialign.image.family.ImageFamily``)
KERNELS: dict[str, type[GaussianStepKernel]] = {k.name: k for k in (DDIMKernel, FlowSDEKernel)}
