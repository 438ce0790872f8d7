"""Flow-matching policies behind the ``Policy`` protocol (issue #13): ``FlowPolicyBase`` (what every
flow-matching family shares) and ``FlowMatchingPolicy`` (the SD3 family, Stable Diffusion 3 / 3.5).
``unialign.image.flux_policy.FluxPolicy`` (FLUX.1) is the other family on the same base.

A trajectory is the N steps x_1 -> ... -> x_0 of diffusers' ``FlowMatchEulerDiscreteScheduler`` made
stochastic by Flow-GRPO's SDE step (``unialign.image.flow.sde_step_with_logprob``, "sde" or "cps"); the
per-step log-prob is that step's Gaussian log-density averaged over C,H,W (the DDPO convention of
``DiffusionPolicy``). With an SDE window (Flow-GRPO-Fast / MixGRPO) only the steps inside the window are
stochastic and trained (``mask_B_T`` 1); the others are deterministic Euler steps x + v dt (mask 0, log-prob 0).
A step of std 0 (the last "cps" step) is deterministic too: mask 0, as Flow-GRPO never trains its last step.
The transformer (``self.model``) is the only trainable module; VAE and text encoders are frozen.

A family is a small adapter over ``FlowPolicyBase``: ``encode_prompts`` (the conditioning dict),
``_velocity`` (one transformer call: CFG, packing, guidance embedding), ``_latent_shape``,
``_set_timesteps`` (the sampling sigmas), ``_pipeline_class`` (the stock pipeline whose
``save_lora_weights`` writes the LoRA) and ``from_pretrained``. Sampling, the step log-probs, the KL to the
reference, the Diffusion-DPO surrogate, the reference and saving are written once here.

SD3 prompt encoding restates ``StableDiffusion3Pipeline.encode_prompt``: the penultimate hidden states of
CLIP-L and CLIP-G concatenated on features and zero-padded to the T5 width, then concatenated on tokens
with T5's last hidden state (zeros of ``max_sequence_length`` tokens when T5 is None, as the stock
pipeline does); pooled = the two projected pooled outputs concatenated. CFG's unconditional branch is the
empty prompt (the stock default negative prompt).

Payload written by ``sample`` (read only by these classes), every tensor with leading B:
    latents              [B, N+1, C, H, W]  x_1 .. x_0, float32 (the kernel's dtype; only the model input is cast),
                                            unpacked for every family (FLUX packs only the transformer's input)
    timesteps            [B, N]             scheduler timesteps (sigma x 1000, float) of each step
    prompt_embeds        [B, L, D]          joint-attention conditioning
    pooled_prompt_embeds [B, P]             pooled conditioning

Payload written by ``preference_batch`` (the Diffusion-DPO surrogate, ``sequence_log_prob``):
    timesteps [B], sigmas [B]  one training timestep per pair and its sigma (t = sigma x 1000)
    noise     [B, C, H, W]     one noise per pair, shared by chosen, rejected, policy and reference
    prompt_embeds, pooled_prompt_embeds as above
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from unialign.image.ddim import HALF_LOG_2PI
from unialign.image.flow import SDE_TYPES, flow_step_coefficients, flow_step_kl, sde_step_with_logprob
from unialign.image.policy import DenoiserPolicy
from unialign.policy import ReferencePolicy
from unialign.types import PreferenceBatch, Trajectory

Tensor = torch.Tensor

# the attention projections of SD3's joint blocks (diffusers' train_dreambooth_lora_sd3.py default)
SD3_LORA_TARGET_MODULES = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
COND_KEYS = ("prompt_embeds", "pooled_prompt_embeds")


def flow_dpo_logp(velocity_B_C_H_W: Tensor, x0_B_C_H_W: Tensor, noise_B_C_H_W: Tensor) -> Tensor:
    """The flow-matching Diffusion-DPO surrogate of one sample [B]: -1/2 mean_CHW (v - (eps - x0))^2, the
    rectified-flow loss at x_t = (1 - sigma) x0 + sigma eps whose target velocity is eps - x0."""
    target = noise_B_C_H_W.float() - x0_B_C_H_W.float()
    return -0.5 * ((velocity_B_C_H_W.float() - target) ** 2).mean(dim=tuple(range(1, target.dim())))


class FlowPolicyBase(DenoiserPolicy):
    """What every flow-matching family shares (module docstring); a family implements ``encode_prompts``,
    ``_velocity``, ``_latent_shape``, ``_set_timesteps``, ``_pipeline_class`` and ``from_pretrained``, and
    calls ``_setup_flow`` from its constructor."""

    family = "flow"

    def _setup_flow(self, transformer, vae, scheduler, frozen: tuple, *, num_steps: int, guidance_scale: float,
                    noise_level: float, sde_type: str, sde_window_size: int, sde_window_range: tuple[int, int] | None,
                    height: int, width: int, max_sequence_length: int, lora_rank: int, lora_alpha: float | None,
                    target_modules: list[str], gradient_checkpointing: bool, sample_batch_size: int,
                    train_chunk_size: int, seed: int, caption_dropout: float) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        if sde_type not in SDE_TYPES:
            raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1], got {caption_dropout}")
        lo, hi = sde_window_range if sde_window_range is not None else (0, num_steps)
        if sde_window_size < 0 or not 0 <= lo < hi <= num_steps or sde_window_size > hi - lo:
            raise ValueError(f"sde_window_size={sde_window_size} with sde_window_range=({lo}, {hi}) must satisfy "
                             f"0 <= size <= hi - lo and 0 <= lo < hi <= num_steps={num_steps}")
        self.transformer = transformer
        self.vae = vae if vae.dtype == torch.float32 else vae.to(torch.float32)
        self.scheduler = (scheduler if isinstance(scheduler, FlowMatchEulerDiscreteScheduler)
                          else FlowMatchEulerDiscreteScheduler.from_config(scheduler.config))
        # the training timesteps / sigmas (num_train_timesteps of them, before set_timesteps), as the
        # diffusers training scripts' ``noise_scheduler_copy``: the Diffusion-DPO surrogate draws from them
        train = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)
        self.train_timesteps = train.timesteps.detach().float().cpu()
        self.train_sigmas = train.sigmas.detach().float().cpu()[: len(self.train_timesteps)]
        self.num_steps, self.guidance_scale = num_steps, guidance_scale
        self.noise_level, self.sde_type = noise_level, sde_type
        self.sde_window_size, self.sde_window_range = sde_window_size, (lo, hi)
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.height, self.width = height, width
        self.max_sequence_length = max_sequence_length
        self.generator = torch.Generator().manual_seed(seed)
        self.caption_dropout = caption_dropout
        self._set_timesteps()
        # validates noise_level for the sde type at once, not at the first step
        flow_step_coefficients(self.scheduler, self.scheduler.timesteps[:1], 1, noise_level, sde_type)
        self._setup_denoiser(transformer, (self.vae, *frozen), lora_rank=lora_rank, lora_alpha=lora_alpha,
                             target_modules=target_modules, gradient_checkpointing=gradient_checkpointing,
                             sample_batch_size=sample_batch_size, train_chunk_size=train_chunk_size)
        self.model = transformer  # trainers may wrap it; forward passes go through self.model
        self._frozen_transformer = None
        self._uncond_cache: dict[str, Tensor] | None = None

    # ------------------------------------------------------------------ family hooks
    def encode_prompts(self, prompts: list[str]) -> dict[str, Tensor]:
        """``prompt_embeds`` [B, L, D] and ``pooled_prompt_embeds`` [B, P] (no grad)."""
        raise NotImplementedError

    def _velocity(self, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor], cfg: bool = True) -> Tensor:
        """The velocity v [B, C, H, W] (unpacked) of ``model`` at (latents [B, C, H, W], scheduler timesteps
        t_B [B]); ``cfg=False`` turns classifier-free guidance off (the DPO surrogate)."""
        raise NotImplementedError

    def _latent_shape(self, batch: int) -> tuple[int, int, int, int]:
        """(B, C, H, W) of the unpacked latents of ``height`` x ``width`` images."""
        raise NotImplementedError

    def _set_timesteps(self) -> None:
        """``self.scheduler.set_timesteps`` for ``num_steps`` as the family's stock pipeline does."""
        raise NotImplementedError

    @classmethod
    def _pipeline_class(cls):
        """The stock diffusers pipeline class (its ``save_lora_weights`` / ``load_lora_weights``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next((p.dtype for p in self.transformer.parameters() if p.is_floating_point()), torch.float32)

    @property
    def _cfg(self) -> bool:
        return self.guidance_scale > 1.0

    def _uncond(self) -> dict[str, Tensor]:
        """Embeddings of the empty prompt (batch 1), cached: the CFG unconditional branch."""
        if self._uncond_cache is None:
            self._uncond_cache = self.encode_prompts([""])
        return self._uncond_cache

    @staticmethod
    def _hub_error(path_or_hub_id: str, what: str, layout: str, offline: bool, err: Exception) -> RuntimeError:
        return RuntimeError(
            f"could not load {what} weights {path_or_hub_id!r}: they are not in a local folder or the Hugging Face "
            f"cache and cannot be downloaded here (offline={offline}). Pass a local directory holding a diffusers "
            f"{layout}. Cause: {type(err).__name__}: {err}")

    @classmethod
    def _load_parts(cls, path_or_hub_id: str, build: Callable[[dict, dict], dict[str, Any]], what: str, layout: str,
                    torch_dtype: torch.dtype | str | None, variant: str | None,
                    device: str | torch.device | None) -> dict[str, Any]:
        """``build(opts, model_kw)`` -> the pipeline's parts, after ``require_hub`` (fails in seconds offline)
        and with hub errors turned into one clear RuntimeError; models moved to ``device``."""
        from unialign.hub import require_hub

        if isinstance(torch_dtype, str):
            torch_dtype = getattr(torch, torch_dtype)
        require_hub(path_or_hub_id, "model")  # fail in seconds, not after a minute of retries
        opts, offline = cls._hub_options(path_or_hub_id)
        try:
            parts = build(opts, dict(opts, torch_dtype=torch_dtype, variant=variant))
        except (OSError, ValueError) as e:  # hub errors (offline, 404, bad id) subclass OSError/ValueError
            raise cls._hub_error(path_or_hub_id, what, layout, offline, e) from e
        if device is not None:
            for part in parts.values():
                if isinstance(part, torch.nn.Module):
                    part.to(device)
        return parts

    def sde_window(self, generator: torch.Generator | None = None) -> tuple[int, int]:
        """[start, end) of the stochastic, trained steps: all N without a window; else a window of
        ``sde_window_size`` steps starting uniformly in [lo, hi - size] (one draw from ``generator``)."""
        if self.sde_window_size == 0:
            return 0, self.num_steps
        lo, hi = self.sde_window_range
        device = generator.device if generator is not None else "cpu"
        start = lo + int(torch.randint(0, hi - self.sde_window_size - lo + 1, (1,), generator=generator,
                                       device=device).item())
        return start, start + self.sde_window_size

    def decode(self, latents_B_C_H_W: Tensor) -> list[Image.Image]:
        """VAE-decode (fp32) unpacked latents to PIL images (latents / scaling_factor + shift_factor, as the
        stock SD3 and FLUX pipelines)."""
        z = latents_B_C_H_W.float() / self.vae.config.scaling_factor
        if getattr(self.vae.config, "shift_factor", None):
            z = z + self.vae.config.shift_factor
        with torch.no_grad():
            pixels = self.vae.decode(z).sample
        arr = ((pixels / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return [Image.fromarray(np.ascontiguousarray(a)) for a in arr]

    @torch.no_grad()
    def encode_images(self, pixels_B_3_H_W: Tensor, sample_posterior: bool = True,
                      generator: torch.Generator | None = None) -> Tensor:
        """Pixels in [-1, 1] -> latents (z - shift_factor) x scaling_factor [B, C, H, W] (VAE in fp32; the
        stock SD3 / FLUX training convention). ``sample_posterior=True`` draws from the VAE posterior as
        Diffusion-DPO does; False takes its mean."""
        dist = self.vae.encode(pixels_B_3_H_W.to(self.device, torch.float32)).latent_dist
        z = dist.sample(generator) if sample_posterior else dist.mean
        if getattr(self.vae.config, "shift_factor", None):
            z = z - self.vae.config.shift_factor
        return z * self.vae.config.scaling_factor

    def draw_training_timesteps(self, batch: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """(timesteps [B], sigmas [B]) float32 drawn uniformly over the scheduler's ``num_train_timesteps``
        training timesteps: diffusers' train_dreambooth_sd3.py / train_dreambooth_lora_flux.py with
        ``weighting_scheme="none"`` (u ~ U[0, 1), index = int(u T), timestep and sigma of
        ``noise_scheduler_copy`` at that index), the flow-matching form of Diffusion-DPO's t ~ U{0..T-1}
        (Wallace et al. 2023)."""
        index = torch.randint(0, len(self.train_timesteps), (batch,), generator=generator or self.generator)
        return self.train_timesteps[index], self.train_sigmas[index]

    # ------------------------------------------------------------------ Policy protocol
    def _sample(self, model, prompts: list[Any], generator: torch.Generator | None) -> Trajectory:
        from diffusers.utils.torch_utils import randn_tensor

        batch = len(prompts)
        cond = self.encode_prompts(prompts)
        latents = randn_tensor(self._latent_shape(batch), generator=generator, device=self.device, dtype=torch.float32)
        start, end = self.sde_window(generator)
        timesteps = self.scheduler.timesteps.to(self.device)
        sigmas = self.scheduler.sigmas.to(self.device, torch.float32)
        coefs = flow_step_coefficients(self.scheduler, self.scheduler.timesteps, self.num_steps, self.noise_level,
                                       self.sde_type)
        all_latents, all_logps = [latents], []
        for i, t in enumerate(timesteps):
            t_B = t.expand(batch)
            v = self._velocity(model, latents, t_B, cond).float()
            if start <= i < end:
                latents, logp, _, _ = sde_step_with_logprob(
                    self.scheduler, v, t_B, latents, self.noise_level, generator=generator, sde_type=self.sde_type,
                    coefficients={k: c[i].expand(batch) for k, c in coefs.items()})
            else:  # deterministic Euler step (FlowMatchEulerDiscreteScheduler.step), not trained
                latents, logp = latents + (sigmas[i + 1] - sigmas[i]) * v, torch.zeros(batch, device=self.device)
            all_latents.append(latents)
            all_logps.append(logp)
        mask = torch.zeros(batch, self.num_steps, device=self.device)
        mask[:, start:end] = 1.0
        # a step of std 0 (the last "cps" step, sigma' = 0) is deterministic: no Gaussian to train or to take
        # a KL of (Flow-GRPO trains int(0.99 N) steps, never the last)
        mask[:, coefs["std"].to(self.device) <= 0] = 0.0
        payload = {"latents": torch.stack(all_latents, dim=1), "timesteps": timesteps.expand(batch, -1).clone(), **cond}
        return Trajectory(prompts=list(prompts), completions=self.decode(latents), mask_B_T=mask,
                          old_logp_B_T=torch.stack(all_logps, dim=1),
                          truncated_B=torch.zeros(batch, dtype=torch.bool, device=self.device), payload=payload)

    def log_prob(self, trajectory: Trajectory) -> Tensor:
        """Differentiable ``logp_B_T`` [B, N] of the recorded steps under the current transformer, with the
        sampling guidance; only steps with ``mask_B_T == 1`` are computed (all in one call), the others are 0."""
        return self._log_prob(self.model, trajectory, False)

    def log_prob_and_entropy(self, trajectory: Trajectory) -> tuple[Tensor, Tensor]:
        """``(logp_B_T, entropy_B_T)``: the entropy per element of the step Gaussian, 0.5 log(2 pi e std^2)
        (independent of theta; 0 where masked or where the step is deterministic, std 0: the last "cps" step)."""
        return self._log_prob(self.model, trajectory, True)

    def log_prob_and_kl(self, trajectory: Trajectory) -> tuple[Tensor, Tensor, Tensor]:
        """``(logp_B_T, entropy_B_T, kl_B_T)`` with the closed-form step KL to ``reference()`` at the same x
        (``flow_step_kl``), differentiable through the policy's mean; 0 where masked."""
        return self._log_prob(self.model, trajectory, True, reference=self.reference())

    def _log_prob(self, model, trajectory: Trajectory, with_entropy: bool, reference: Any = None) -> Any:
        payload = trajectory.payload
        latents, timesteps = payload["latents"], payload["timesteps"]
        batch, steps = timesteps.shape
        logp_B_T = torch.zeros(batch, steps, device=latents.device, dtype=torch.float32)
        kl_B_T = torch.zeros_like(logp_B_T)
        rows, cols = (trajectory.mask_B_T.to(latents.device) > 0).nonzero(as_tuple=True)
        if rows.numel() > 0:
            t_R, x_R = timesteps[rows, cols], latents[rows, cols]
            cond = {k: payload[k][rows] for k in COND_KEYS}
            v = self._velocity(model, x_R, t_R, cond)
            _, logp, mean, std = sde_step_with_logprob(self.scheduler, v, t_R, x_R, self.noise_level,
                                                       prev_sample=latents[rows, cols + 1], sde_type=self.sde_type)
            logp_B_T = logp_B_T.index_put((rows, cols), logp)
            if reference is not None:
                with reference._frozen():
                    ref_v = self._velocity(reference.model, x_R, t_R, cond)
                _, _, ref_mean, _ = sde_step_with_logprob(self.scheduler, ref_v, t_R, x_R, self.noise_level,
                                                          prev_sample=latents[rows, cols + 1], sde_type=self.sde_type)
                kl_B_T = kl_B_T.index_put((rows, cols), flow_step_kl(mean, ref_mean, std))
        if not with_entropy:
            return logp_B_T
        std_B_T = flow_step_coefficients(self.scheduler, timesteps.reshape(-1).cpu(), batch * steps, self.noise_level,
                                         self.sde_type)["std"].view(batch, steps).to(logp_B_T.device, torch.float32)
        live = (trajectory.mask_B_T.to(logp_B_T.device) > 0) & (std_B_T > 0)
        entropy_B_T = torch.where(live, 0.5 + HALF_LOG_2PI + torch.log(std_B_T.clamp(min=1e-30)),
                                  torch.zeros_like(std_B_T))
        if reference is None:
            return logp_B_T, entropy_B_T
        return logp_B_T, entropy_B_T, kl_B_T

    @torch.no_grad()
    def preference_batch(self, rows: list[dict[str, Any]], resolution: int | None = None) -> PreferenceBatch:
        """Pairs from ``unialign.image.data.normalize_pickapic`` (``prompt``, ``chosen``, ``rejected`` PIL images)
        -> a ``PreferenceBatch``: each image resized / centre-cropped to ``resolution`` (default: the policy's
        height), VAE-encoded (posterior sample, fp32, (z - shift_factor) x scaling_factor) into
        ``chosen["latents"]`` / ``rejected["latents"]`` [B, C, H, W]; ONE training timestep / sigma and ONE
        noise per pair in ``payload`` (``draw_training_timesteps``; shared by chosen, rejected, policy and
        reference); the prompt embeddings, each caption replaced by "" with probability ``caption_dropout``
        while the transformer is in training mode (as ``DiffusionPolicy``)."""
        from diffusers.utils.torch_utils import randn_tensor

        from unialign.image.data import to_pixels

        res = resolution or self.height
        multiple = self._pixel_multiple()
        if res % multiple:
            raise ValueError(f"resolution {res} must be a multiple of {multiple} for {type(self).__name__}")
        captions = [r["prompt"] for r in rows]
        if self.caption_dropout and self.transformer.training:
            drop = torch.rand(len(rows), generator=self.generator) < self.caption_dropout
            captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
        sides = []
        for key in ("chosen", "rejected"):
            pixels = torch.stack([to_pixels(r[key], res)[0] for r in rows])
            sides.append({"latents": self.encode_images(pixels, generator=self.generator)})
        timesteps, sigmas = self.draw_training_timesteps(len(rows))
        payload = {"timesteps": timesteps, "sigmas": sigmas,
                   "noise": randn_tensor(tuple(sides[0]["latents"].shape), generator=self.generator,
                                         dtype=torch.float32),
                   **self.encode_prompts(captions)}
        return PreferenceBatch(prompts=captions, chosen=sides[0], rejected=sides[1], payload=payload)

    def _pixel_multiple(self) -> int:
        """Image sizes must be multiples of this (the VAE factor; x2 where latents are packed 2x2)."""
        return self.vae_scale_factor

    def sequence_log_prob(self, batch: PreferenceBatch, length_normalize: bool = False) -> tuple[Tensor, Tensor]:
        """Diffusion-DPO ELBO **surrogate** (Wallace et al. 2023) for rectified flow, NOT the image's
        log-likelihood:

            logp = -1/2 * mean_CHW || v_theta(x_t, t, c) - (eps - x0) ||^2,   x_t = (1 - sigma) x0 + sigma eps

        i.e. minus half the flow-matching training loss of SD3 / FLUX (diffusers' train_dreambooth_sd3.py:
        target = noise - model_input, uniform weighting), in place of the eps-MSE of the UNet version. One
        (t, sigma) and one eps per pair shared by chosen and rejected (identical images give identical
        values), both sides in one doubled transformer call, no CFG (FLUX-dev keeps its guidance embedding at
        the policy's ``guidance_scale``: ``FluxPolicy``). Reads ``batch.chosen["latents"]`` /
        ``batch.rejected["latents"]`` [B, C, H, W] (``encode_images``), optionally ``payload["timesteps"]``
        / ``["sigmas"]`` [B] (else drawn: ``draw_training_timesteps``; sigma = t / num_train_timesteps when
        only t is given), ``["noise"]`` [B, C, H, W] (else drawn from the policy's generator) and the prompt
        embeddings (else the prompts are encoded). ``length_normalize`` is ignored (already a mean).
        Returns (chosen_B, rejected_B)."""
        return self._sequence_log_prob(self.model, batch, length_normalize)

    def _sequence_log_prob(self, model, batch: PreferenceBatch, length_normalize: bool = False) -> tuple[Tensor, Tensor]:
        from diffusers.utils.torch_utils import randn_tensor

        chosen = batch.chosen["latents"].to(self.device, torch.float32)
        rejected = batch.rejected["latents"].to(self.device, torch.float32)
        b = chosen.shape[0]
        t_B, sigma_B = batch.payload.get("timesteps"), batch.payload.get("sigmas")
        if t_B is None:
            t_B, sigma_B = self.draw_training_timesteps(b)
        elif sigma_B is None:
            sigma_B = torch.as_tensor(t_B, dtype=torch.float32) / self.scheduler.config.num_train_timesteps
        t_B = torch.as_tensor(t_B, dtype=torch.float32).to(self.device)
        sigma_B = torch.as_tensor(sigma_B, dtype=torch.float32).to(self.device)
        noise = batch.payload.get("noise")
        if noise is None:
            noise = randn_tensor(chosen.shape, generator=self.generator, dtype=torch.float32)
        noise = noise.to(self.device, torch.float32)
        if all(k in batch.payload for k in COND_KEYS):
            cond = {k: batch.payload[k].to(self.device, self.dtype) for k in COND_KEYS}
        else:
            cond = self.encode_prompts(batch.prompts)
        cond = {k: torch.cat([v, v]) for k, v in cond.items()}
        x0, eps = torch.cat([chosen, rejected]), torch.cat([noise, noise])
        sigma = torch.cat([sigma_B, sigma_B]).view(-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - sigma) * x0 + sigma * eps
        v = self._velocity(model, x_t, torch.cat([t_B, t_B]), cond, cfg=False)
        logp = flow_dpo_logp(v, x0, eps)
        return logp[:b], logp[b:]

    def reference(self) -> ReferencePolicy:
        """The frozen reference: the same transformer with LoRA adapters disabled, or (full fine-tuning) a
        frozen deep copy made on the first call; call it before training starts."""
        if self.lora_rank > 0:
            return ReferencePolicy(self, None, self._adapters_disabled)
        if self._frozen_transformer is None:
            self._frozen_transformer = copy.deepcopy(self.transformer).requires_grad_(False).eval()
        return ReferencePolicy(self, self._frozen_transformer)

    def save(self, path: str) -> None:
        """LoRA: ``pytorch_lora_weights.safetensors`` in ``path`` (the stock pipeline's ``save_lora_weights``:
        ``StableDiffusion3Pipeline`` / ``FluxPipeline``), loadable with its stock ``load_lora_weights(path)``.
        Full fine-tuning: the transformer in ``path/transformer``. Called on every process; the main
        process writes."""
        from unialign.dist import is_main_rank

        if not is_main_rank():
            return
        os.makedirs(path, exist_ok=True)
        if self.lora_rank == 0:
            self.transformer.save_pretrained(os.path.join(path, "transformer"))
            return
        from peft.utils import get_peft_model_state_dict

        layers = get_peft_model_state_dict(self.transformer)
        metadata = self.transformer.peft_config["default"].to_dict()
        metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
        self._pipeline_class().save_lora_weights(path, transformer_lora_layers=layers,
                                                 transformer_lora_adapter_metadata=metadata)


class FlowMatchingPolicy(FlowPolicyBase):
    """SD3-family policy sampling with a stochastic flow-matching step that records per-step log-probs.

    Args:
        transformer: ``SD3Transformer2DModel``.  vae: ``AutoencoderKL`` (decoded in fp32).
        text_encoder, tokenizer / text_encoder_2, tokenizer_2: CLIP-L / CLIP-G
            (``CLIPTextModelWithProjection``).  text_encoder_3, tokenizer_3: T5 encoder, or None (zeros).
        scheduler: a ``FlowMatchEulerDiscreteScheduler`` (any other is converted with the same config).
        num_steps: N sampling steps.  guidance_scale: CFG weight w (> 1 turns CFG on, in sampling and in the
            recomputed log-prob, one doubled batch; never in the DPO surrogate).  noise_level: eta of the SDE
            step (Flow-GRPO: 0.7 for "sde", 0.8 for "cps").  sde_type: "sde" or "cps" (``unialign.image.flow``).
        sde_window_size: 0 (default): every step is stochastic and trained. k > 0: per ``sample`` call one
            window of k consecutive steps, starting at a step drawn uniformly (from the sampling generator)
            in [lo, hi - k] with (lo, hi) = ``sde_window_range`` (default (0, N)); only these steps are
            stochastic and trained (Flow-GRPO-Fast).
        height, width: image size in pixels (default: transformer sample_size x VAE scale factor).
        max_sequence_length: T5 tokens (also the zero block's length when T5 is None; stock default 256).
        lora_rank: > 0 adds a peft LoRA (alpha = ``lora_alpha`` or rank) on the transformer's attention
            projections (``SD3_LORA_TARGET_MODULES``) and freezes the base; 0 trains the full transformer.
        gradient_checkpointing: transformer gradient checkpointing.
        sample_batch_size: ``sample`` denoises this many prompts at a time (0: all at once); each chunk
            draws its own SDE window.
        train_chunk_size: (sample, step) pairs per forward / backward in training (``step_chunks``, shared with
            ``DiffusionPolicy`` in ``DenoiserPolicy``); 0: all trained steps of a micro-batch in one call.
        seed: seeds the policy's own generator (``self.generator``), used by ``preference_batch`` and by
            ``sequence_log_prob`` when a batch carries no timesteps / noise (``DiffusionPolicy``'s name).
        caption_dropout: probability of training a preference pair on the empty caption (Diffusion-DPO
            uses 0.2), so classifier-free guidance keeps working (``DiffusionPolicy``'s name).
        cfg_uncond_grad: with CFG in training, the gradient also flows through the unconditional branch;
            default False: Flow-GRPO's training step computes it under no_grad (``DenoiserPolicy._guided``).
    """

    family = "sd3"

    def __init__(
        self,
        transformer,
        vae,
        text_encoder,
        tokenizer,
        text_encoder_2,
        tokenizer_2,
        scheduler,
        text_encoder_3=None,
        tokenizer_3=None,
        *,
        num_steps: int = 10,
        guidance_scale: float = 4.5,
        noise_level: float = 0.7,
        sde_type: str = "sde",
        sde_window_size: int = 0,
        sde_window_range: tuple[int, int] | None = None,
        height: int | None = None,
        width: int | None = None,
        max_sequence_length: int = 256,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
        gradient_checkpointing: bool = False,
        sample_batch_size: int = 0,
        train_chunk_size: int = 0,
        seed: int = 0,
        caption_dropout: float = 0.0,
        cfg_uncond_grad: bool = False,
    ) -> None:
        if (text_encoder_3 is None) != (tokenizer_3 is None):
            raise ValueError("text_encoder_3 and tokenizer_3 go together (both None: no T5, zeros as the stock pipeline)")
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        self.text_encoder_3, self.tokenizer_3 = text_encoder_3, tokenizer_3
        scale = 2 ** (len(vae.config.block_out_channels) - 1)
        self._setup_flow(transformer, vae, scheduler, (text_encoder, text_encoder_2, text_encoder_3),
                         num_steps=num_steps, guidance_scale=guidance_scale, noise_level=noise_level,
                         sde_type=sde_type, sde_window_size=sde_window_size, sde_window_range=sde_window_range,
                         height=height or transformer.config.sample_size * scale,
                         width=width or transformer.config.sample_size * scale,
                         max_sequence_length=max_sequence_length, lora_rank=lora_rank, lora_alpha=lora_alpha,
                         target_modules=SD3_LORA_TARGET_MODULES, gradient_checkpointing=gradient_checkpointing,
                         sample_batch_size=sample_batch_size, train_chunk_size=train_chunk_size, seed=seed,
                         caption_dropout=caption_dropout)
        self.cfg_uncond_grad = cfg_uncond_grad

    def _set_timesteps(self) -> None:
        """``set_timesteps(N)`` with the stock pipeline's dynamic-shift ``mu`` when the config asks for it."""
        kwargs = {}
        config = self.scheduler.config
        if config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            patch = self.transformer.config.patch_size
            seq = (self.height // self.vae_scale_factor // patch) * (self.width // self.vae_scale_factor // patch)
            kwargs["mu"] = calculate_shift(seq, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                                           config.get("base_shift", 0.5), config.get("max_shift", 1.16))
        self.scheduler.set_timesteps(self.num_steps, **kwargs)

    def _latent_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.transformer.config.in_channels, self.height // self.vae_scale_factor,
                self.width // self.vae_scale_factor)

    @classmethod
    def _pipeline_class(cls):
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, lora_rank: int = 0, torch_dtype: torch.dtype | str | None = None,
                        device: str | torch.device | None = None, load_t5: bool = True, variant: str | None = None,
                        **kwargs: Any) -> FlowMatchingPolicy:
        """Load the parts of a diffusers ``StableDiffusion3Pipeline`` folder or hub id. ``load_t5=False``
        (or a folder without ``text_encoder_3``) leaves T5 out (zeros, as the stock pipeline allows).
        ``kwargs`` go to the constructor. Fails at once with a RuntimeError when the weights are neither
        local nor downloadable (offline, unknown id, no network)."""

        def build(opts: dict, model_kw: dict) -> dict[str, Any]:
            from diffusers import (
                AutoencoderKL,
                DiffusionPipeline,
                FlowMatchEulerDiscreteScheduler,
                SD3Transformer2DModel,
            )
            from transformers import CLIPTextModelWithProjection, CLIPTokenizer

            config = DiffusionPipeline.load_config(path_or_hub_id, **opts)
            clip = CLIPTextModelWithProjection
            parts = {
                "transformer": SD3Transformer2DModel.from_pretrained(path_or_hub_id, subfolder="transformer", **model_kw),
                "vae": AutoencoderKL.from_pretrained(path_or_hub_id, subfolder="vae", **opts),
                "text_encoder": clip.from_pretrained(path_or_hub_id, subfolder="text_encoder", **model_kw),
                "tokenizer": CLIPTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer", **opts),
                "text_encoder_2": clip.from_pretrained(path_or_hub_id, subfolder="text_encoder_2", **model_kw),
                "tokenizer_2": CLIPTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_2", **opts),
                "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(path_or_hub_id, subfolder="scheduler", **opts),
            }
            if load_t5 and (config.get("text_encoder_3") or [None])[0] is not None:
                from transformers import AutoTokenizer, T5EncoderModel

                parts["text_encoder_3"] = T5EncoderModel.from_pretrained(path_or_hub_id, subfolder="text_encoder_3",
                                                                         **model_kw)
                parts["tokenizer_3"] = AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_3", **opts)
            return parts

        layout = ("StableDiffusion3Pipeline (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, "
                  "text_encoder_2/, tokenizer_2/, scheduler/[, text_encoder_3/, tokenizer_3/])")
        parts = cls._load_parts(path_or_hub_id, build, "SD3", layout, torch_dtype, variant, device)
        return cls(**parts, lora_rank=lora_rank, **kwargs)

    # ------------------------------------------------------------------ SD3 conditioning
    def _clip(self, tokenizer, encoder, prompts: list[str]) -> tuple[Tensor, Tensor]:
        ids = tokenizer(list(prompts), padding="max_length", max_length=self.tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids.to(self.device)
        out = encoder(ids, output_hidden_states=True)
        return out.hidden_states[-2], out[0]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, Tensor]:
        """``StableDiffusion3Pipeline.encode_prompt`` (clip_skip None, one image per prompt):
        ``prompt_embeds`` [B, 77 + T5 tokens, joint_attention_dim] and ``pooled_prompt_embeds`` [B, P_L + P_G]."""
        h1, p1 = self._clip(self.tokenizer, self.text_encoder, prompts)
        h2, p2 = self._clip(self.tokenizer_2, self.text_encoder_2, prompts)
        clip = torch.cat([h1, h2], dim=-1)
        if self.text_encoder_3 is None:
            t5 = torch.zeros(len(prompts), self.max_sequence_length, self.transformer.config.joint_attention_dim,
                             device=self.device, dtype=clip.dtype)
        else:
            ids = self.tokenizer_3(list(prompts), padding="max_length", max_length=self.max_sequence_length,
                                   truncation=True, add_special_tokens=True, return_tensors="pt").input_ids
            t5 = self.text_encoder_3(ids.to(self.device))[0]
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        embeds = torch.cat([clip.to(t5.dtype), t5], dim=-2)
        return {"prompt_embeds": embeds.to(self.dtype), "pooled_prompt_embeds": torch.cat([p1, p2], dim=-1).to(self.dtype)}

    def _velocity(self, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor], cfg: bool = True) -> Tensor:
        """The (guided) velocity v [B, C, H, W] at (latents, t); with CFG (``cfg`` and guidance_scale > 1)
        one doubled batch [uncond; cond] and u + w (c - u), as the stock pipeline."""
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        x = latents.to(self.dtype)

        def call(hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                 pooled_projections: Tensor) -> Tensor:
            return model(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                         pooled_projections=pooled_projections, return_dict=False)[0]

        if not (cfg and self._cfg):
            return call(x, t_B, embeds, pooled)
        b, uncond = x.shape[0], self._uncond()
        doubled = dict(hidden_states=torch.cat([x, x]), timestep=torch.cat([t_B, t_B]),
                       encoder_hidden_states=torch.cat([uncond["prompt_embeds"].expand(b, -1, -1), embeds]),
                       pooled_projections=torch.cat([uncond["pooled_prompt_embeds"].expand(b, -1), pooled]))
        return self._guided(call, doubled, b)
