"""``DenoiserPolicy``: the one part every denoising policy shares.

Written once here: trajectory recording (``sample``: the loop over the N steps, the trained-steps mask,
the payload), the per-step log-probs over the trained steps with the closed-form KL to the reference and
the step entropy (``log_prob``, ``log_prob_and_entropy``, ``log_prob_and_kl``), the Diffusion-DPO pairs and
their ELBO surrogate (``preference_batch``, ``sequence_log_prob``), the reference (adapters off, or a frozen
copy), LoRA set-up and saving in diffusers' ``load_lora_weights`` format, chunked sampling, step-chunked
training and classifier-free guidance with or without a gradient through the unconditional branch.

It is composed of the pipeline family (the subclass and the family adapter it holds: ``DiffusionPolicy`` with
``SD1Family`` / ``SDXLFamily`` for SD1.x / SDXL UNets, ``FlowPolicyBase`` with ``SD3Family`` / ``FluxFamily`` for
SD3 / FLUX transformers) and one step kernel, ``self.kernel`` (``unialign.image.kernels``: how trajectories are
sampled and scored, e.g. the DDIM step or Flow-GRPO's SDE step), which reads the family only through
``_sampling_cond``, ``_initial_latents``, ``_denoise``, ``decode``, ``scheduler``, ``num_steps``, ``_cfg`` and
``cond_keys``. The family's hooks (all tensors batch-first):

    sampling    _sampling_cond(prompts)                   the payload's conditioning for B prompts
                _initial_latents(batch, generator)         x_T [B, C, H, W]
    the model   _denoise(model, x, t_B, cond, cfg)        the (guided) model output at x_t
    pairs       _draw_pair_times(b)                        one training time per pair, for the payload
                _pair_times(payload, b)                    the payload's times (drawn when missing)
                _noised(x0, eps, times) -> (x_t, t, target)  forward noising and the regression target
                _side_cond(sizes, crops, resolution)       per-side extra conditioning of new pairs (SDXL size ids)
                _pair_side_cond(batch, latent_shape)       the same read back from a pair batch, chosen then rejected
                _pixel_multiple()                          image sizes must be multiples of it
    saving      _pipeline_class(), _lora_layers(state)     the stock pipeline whose save_lora_weights writes

and these attributes: ``denoiser`` (the one trainable module, ``_setup_denoiser``), ``model`` (what forward
passes go through: a trainer may wrap it), ``vae`` (fp32), ``scheduler``, ``num_steps``,
``guidance_scale``, ``height``, ``vae_scale_factor``, ``generator``, ``caption_dropout``, ``cond_keys``
(the payload's per-row conditioning), ``text_keys`` (the prompt-embedding part of it) and
``denoiser_subfolder`` ("unet" / "transformer").
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from PIL import Image

from unialign.policy import (
    ClosedFormKL,
    LossTerms,
    OptimizerStepHook,
    PolicyBase,
    ReferencePolicy,
    StepChunks,
    StepStatistics,
)
from unialign.types import PreferenceBatch, Trajectory

Tensor = torch.Tensor
TEXT_PARTS = ("text_encoder", "tokenizer")  # the prefixes of the text parts' component names


class DenoiserPolicy(PolicyBase, ClosedFormKL, LossTerms, StepChunks, OptimizerStepHook, StepStatistics):
    """What every denoising policy shares (module docstring). ``DiffusionPolicy`` (SD1.x / SDXL UNets, the DDIM
    step) and ``FlowPolicyBase`` (SD3 / FLUX transformers, Flow-GRPO's SDE step) implement the hooks."""

    #: classifier-free guidance in training: True computes the gradient through both branches of u + w (c - u)
    #: (DDPO as published, one doubled batch); False computes the unconditional u under no_grad on its own
    #: (Flow-GRPO's training step: no gradient through u, its activations never kept). Sampling and the
    #: recomputed log-prob values are the same either way. Set by the subclasses' constructors.
    cfg_uncond_grad: bool = True
    #: the CFG unconditional branch uses zeros instead of the empty prompt's embeddings (stock SDXL's option)
    force_zeros_for_empty_prompt: bool = False
    denoiser_subfolder = "denoiser"
    _uncond_cache: dict[str, Tensor] | None = None
    _frozen_denoiser: torch.nn.Module | None = None

    # ------------------------------------------------------------------ the family's parts
    @property
    def cond_keys(self) -> tuple[str, ...]:
        """The conditioning a trajectory payload carries (the family adapter's)."""
        return self.family.cond_keys

    @property
    def text_keys(self) -> tuple[str, ...]:
        """The prompt-embedding part of ``cond_keys`` (the family adapter's)."""
        return self.family.text_keys

    def __getattr__(self, name: str) -> Any:
        """A text part of the family by its diffusers component name (``policy.text_encoder``,
        ``policy.tokenizer_2``: None where the family has no such part); read-only (the adapter holds it)."""
        if name.startswith(TEXT_PARTS) and "family" in self.__dict__:
            return self.family.parts.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith(TEXT_PARTS) and "family" in self.__dict__:
            raise AttributeError(f"{name} is read-only: the family adapter holds the text parts")
        super().__setattr__(name, value)

    # ------------------------------------------------------------------ set-up
    def _setup_denoiser(self, denoiser, frozen: tuple, *, lora_rank: int, lora_alpha: float | None,
                        target_modules: list[str], gradient_checkpointing: bool, sample_batch_size: int,
                        train_chunk_size: int) -> None:
        if train_chunk_size < 0:
            raise ValueError(f"train_chunk_size must be >= 0 (0: no chunking), got {train_chunk_size}")
        if sample_batch_size < 0:
            raise ValueError(f"sample_batch_size must be >= 0 (0: the whole batch at once), got {sample_batch_size}")
        self.train_chunk_size, self.sample_batch_size = train_chunk_size, sample_batch_size
        for module in frozen:
            if module is not None:
                module.requires_grad_(False).eval()
        self.denoiser, self.lora_rank = denoiser, lora_rank
        if lora_rank > 0:
            from peft import LoraConfig

            denoiser.requires_grad_(False)
            denoiser.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_alpha or lora_rank,
                                            init_lora_weights="gaussian", target_modules=target_modules))
            for p in denoiser.parameters():  # trainable LoRA weights in fp32 even for a half-precision model
                if p.requires_grad:
                    p.data = p.data.float()
        else:
            denoiser.requires_grad_(True)
        if gradient_checkpointing:
            denoiser.enable_gradient_checkpointing()
        self.model = denoiser  # trainers may wrap it (DDP/FSDP); forward passes go through self.model

    @staticmethod
    def _hub_options(path_or_hub_id: str) -> tuple[dict[str, Any], bool]:
        """(``from_pretrained`` options, offline?): ``local_files_only`` when offline and not a local folder."""
        from huggingface_hub import constants as hub_constants

        offline = hub_constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        return ({"local_files_only": True} if (offline and not os.path.isdir(path_or_hub_id)) else {}), offline

    @classmethod
    def _load_parts(cls, path_or_hub_id: str, build: Callable[[dict, dict], dict[str, Any]], what: str, layout: str,
                    torch_dtype: torch.dtype | str | None, variant: str | None,
                    device: str | torch.device | None, also_required: tuple[str, ...] = (),
                    sources: dict[str, str] | None = None) -> dict[str, Any]:
        """``build(opts, model_kw)`` -> the pipeline's parts, after ``require_hub`` on ``path_or_hub_id`` and
        ``also_required`` (fails in seconds offline) and with hub errors turned into one clear RuntimeError;
        models moved to ``device``; every model's weights checked finite (``unialign.weights.check_finite``:
        a ``UserError`` naming the model path -- ``sources[part]`` for a part loaded from elsewhere, e.g. a
        replacement VAE -- the part and the first NaN / inf tensor)."""
        from unialign.hub import require_hub
        from unialign.weights import check_finite

        if isinstance(torch_dtype, str):
            torch_dtype = getattr(torch, torch_dtype)
        for name in (path_or_hub_id, *also_required):
            require_hub(name, "model")  # fail in seconds, not after a minute of retries
        opts, offline = cls._hub_options(path_or_hub_id)
        from unialign.errors import UserError

        try:
            parts = build(opts, dict(opts, torch_dtype=torch_dtype, variant=variant))
        except UserError:  # a family's own verdict on what it read (one line already)
            raise
        except (OSError, ValueError) as e:  # hub errors (offline, 404, bad id) subclass OSError/ValueError
            raise RuntimeError(
                f"could not load {what} weights {path_or_hub_id!r}: they are not in a local folder or the Hugging "
                f"Face cache and cannot be downloaded here (offline={offline}). Pass a local directory holding a "
                f"diffusers {layout}. Cause: {type(e).__name__}: {e}") from e
        if device is not None:
            for part in parts.values():
                if isinstance(part, torch.nn.Module):
                    part.to(device)
        for name, part in parts.items():
            if isinstance(part, torch.nn.Module):
                source = (sources or {}).get(name)
                check_finite(part, source or path_or_hub_id, None if source else name)
        return parts

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The denoiser's dtype: its first floating-point parameter's. (diffusers' ``unet.dtype`` says the same
        but walks every module on each read, once per sampling step; docs/benchmarks.md, row P4.)"""
        return next((p.dtype for p in self.denoiser.parameters() if p.is_floating_point()), torch.float32)

    @property
    def _cfg(self) -> bool:
        return self.guidance_scale > 1.0

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def _uncond(self) -> dict[str, Tensor]:
        """Embeddings of the empty prompt (batch 1), cached: the CFG unconditional branch (zeros with
        ``force_zeros_for_empty_prompt``)."""
        if self._uncond_cache is None:
            cond = self.encode_prompts([""])
            if self.force_zeros_for_empty_prompt:
                cond = {k: torch.zeros_like(v) for k, v in cond.items()}
            self._uncond_cache = cond
        return self._uncond_cache

    def _guided(self, call, doubled: dict[str, Any], rows: int) -> Tensor:
        """u + w (c - u) from ``call(**doubled)`` on a doubled batch [uncond x R; cond x R]: every tensor input
        (and every tensor of a dict input) has 2R rows. With ``cfg_uncond_grad`` False and gradients enabled,
        the two halves run separately, the unconditional one under ``torch.no_grad``."""
        if self.cfg_uncond_grad or not torch.is_grad_enabled():
            out_uncond, out_cond = call(**doubled).chunk(2)
        else:
            def half(rows_slice: slice) -> dict[str, Any]:
                def cut(v: Any) -> Any:
                    if torch.is_tensor(v):
                        return v[rows_slice]
                    return {k: cut(x) for k, x in v.items()} if isinstance(v, dict) else v
                return {k: cut(v) for k, v in doubled.items()}

            with torch.no_grad():
                out_uncond = call(**half(slice(0, rows)))
            out_cond = call(**half(slice(rows, None)))
        return out_uncond + self.guidance_scale * (out_cond - out_uncond)

    def step_chunks(self, mask_B_T: Tensor) -> list[Tensor]:
        """The trained (sample, step) pairs of ``mask_B_T`` [B, N] split into chunks of at most
        ``train_chunk_size``, step by step (all samples' first trained step, then the next, ...): a list of
        {0, 1} masks [B, N] whose sum is ``mask_B_T`` (``[mask_B_T]`` when chunking is off or one chunk
        holds everything). A trainer computes the loss of each chunk under the whole batch's normaliser and
        runs one backward per chunk."""
        rows, cols = (mask_B_T > 0).nonzero(as_tuple=True)
        size = self.train_chunk_size
        if size <= 0 or rows.numel() <= size:
            return [mask_B_T]
        order = torch.argsort(cols * mask_B_T.shape[0] + rows)
        chunks = []
        for part in order.split(size):
            sub = torch.zeros_like(mask_B_T)
            sub[rows[part], cols[part]] = mask_B_T[rows[part], cols[part]]
            chunks.append(sub)
        return chunks

    def decode(self, latents_B_C_H_W: Tensor) -> list[Image.Image]:
        """VAE-decode (fp32) latents to PIL images (``decode_images``)."""
        return decode_images(self.vae, latents_B_C_H_W)

    @torch.no_grad()
    def encode_images(self, pixels_B_3_H_W: Tensor, sample_posterior: bool = True,
                      generator: torch.Generator | None = None) -> Tensor:
        """Pixels in [-1, 1] -> latents (``encode_images``)."""
        return encode_images(self.vae, pixels_B_3_H_W.to(self.device), sample_posterior, generator)

    @property
    def output_kind(self) -> tuple[str, str]:
        """What one sample is and the stock pipeline output's field holding them (the family's: ("image",
        "images"), a video family's ("video", "frames"))."""
        return self.family.output_kind

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample(self, prompts: list[Any], generator: torch.Generator | None = None,
               record_logp: bool = True) -> Trajectory:
        """One image per prompt, recording what the kernel trains on (a Gaussian-step kernel: every latent, the
        timesteps, the conditioning and each step's log-prob, which come free with each step, so ``record_logp``
        is ignored; the forward kernel: the clean latent, the condition and its (t, eps) pairs). With
        ``sample_batch_size`` the prompts are denoised in chunks of that many, one after the other from the
        same generator."""
        size = self.sample_batch_size
        if size <= 0 or len(prompts) <= size:
            return self._sample(self.model, prompts, generator, record_logp)
        return Trajectory.cat([self._sample(self.model, list(prompts[i:i + size]), generator, record_logp)
                               for i in range(0, len(prompts), size)])

    def _sample(self, model, prompts: list[Any], generator: torch.Generator | None,
                record_logp: bool = True) -> Trajectory:
        """One trajectory per prompt with ``model`` (the policy's or the reference's): the kernel's sampler."""
        return self.kernel.sample(self, model, prompts, generator, record_logp)

    # ------------------------------------------------------------------ Policy protocol
    def log_prob(self, trajectory: Trajectory) -> Tensor:
        """Differentiable ``logp_B_T`` [B, N] of the recorded transitions under the current denoiser, with the
        sampling guidance (the gradient through CFG's unconditional branch as ``cfg_uncond_grad`` says).
        Only steps with ``mask_B_T == 1`` are computed (all of them in one call); the others are 0."""
        return self._log_prob(self.model, trajectory, False)

    def log_prob_and_entropy(self, trajectory: Trajectory) -> tuple[Tensor, Tensor]:
        """``(logp_B_T, entropy_B_T)``: ``log_prob`` and the entropy of the step Gaussian per element,
        0.5 * log(2 pi e std^2) (the same for every element, so equal to its mean over C,H,W). It does not
        depend on theta (std is fixed by the scheduler), so it carries no gradient; 0 where masked or where
        the step is deterministic (std 0)."""
        return self._log_prob(self.model, trajectory, True)

    def log_prob_and_kl(self, trajectory: Trajectory) -> tuple[Tensor, Tensor, Tensor]:
        """``(logp_B_T, entropy_B_T, kl_B_T)``: ``log_prob_and_entropy(trajectory)`` plus the closed-form KL of
        each trained step to the reference's step at the same x_t (both Gaussians with the step's std, so
        KL_t = mean_CHW (mu_theta - mu_ref)^2 / (2 std^2): the kernel's ``step_kl``), differentiable through mu_theta; 0
        where masked. The reference (``reference()``: adapters off, or the frozen copy) runs here, without
        gradients, with the same CFG -- as Flow-GRPO's training step does -- so the trainer needs no
        reference pass of its own."""
        return self._log_prob(self.model, trajectory, True, reference=self.reference())

    def _log_prob(self, model, trajectory: Trajectory, with_entropy: bool, reference: Any = None) -> Any:
        """The kernel's log-probs of ``trajectory`` under ``model`` (with entropy; with a reference: the KL)."""
        return self.kernel.log_prob(self, model, trajectory, with_entropy, reference)

    def prepare_terms(self, names: tuple[str, ...]) -> None:
        """``LossTerms.prepare_terms``: the step kernel's (``offered_terms``); call it again after
        ``use_forward_process``, which replaces the kernel."""
        self.kernel.prepare_terms(tuple(names))

    def log_prob_terms(self, trajectory: Trajectory, names: tuple[str, ...],
                       with_kl: bool = False) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Any]]:
        """(logp_B_T, entropy_B_T, kl_B_T or None, {name: ...}): the log-probs with the extra per-step terms a
        registered policy loss reads (``unialign.algos.policy_loss``; e.g. ``"nft"``), in one model call; the
        closed-form KL to ``reference()`` when ``with_kl``."""
        return self.kernel.terms(self, self.model, trajectory, tuple(names), self.reference() if with_kl else None)

    @property
    def closed_form_kls(self) -> tuple[str, ...]:
        """The closed-form KL estimators the kernel computes (``log_prob_and_kl``)."""
        return self.kernel.closed_form_kls

    @property
    def per_step_diagnostics(self) -> bool:
        """``StepStatistics``: a sampler's steps are the same for every sample; the forward
        process's pairs are not (their times are drawn per sample)."""
        return self.kernel.estimator == "sampler"

    @property
    def log_prob_estimator(self) -> str:
        """What ``log_prob`` estimates: "sampler" (the recorded sampler's step densities) or "forward" (the
        forward-process matching surrogate): an algorithm's ``log_prob_estimator`` must match it."""
        return self.kernel.estimator

    # ------------------------------------------------------------------ forward-process RL
    #: the old policy's decay schedule step -> decay (an exponential moving average of the trained weights,
    #: updated by ``after_optimizer_step``); None: no old policy, ``_old_weights`` is the current one
    old_decay: Callable[[int], float] | None = None
    _old_state: list[Tensor] | None = None

    def use_forward_process(self, old_decay: Callable[[int], float] | None = None, **kernel_kwargs: Any) -> None:
        """Train on the forward process (``unialign.image.kernels.ForwardKernel(num_steps, **kernel_kwargs)``:
        AWM, DiffusionNFT) instead of the sampler's steps; ``old_decay`` keeps an old policy, a moving average of
        the trained weights (DiffusionNFT's), for the NFT terms and, with ``sample_old``, for collection."""
        from unialign.image.kernels import ForwardKernel

        self.kernel = ForwardKernel(self.num_steps, **kernel_kwargs)
        self.old_decay = old_decay
        if old_decay is not None:
            self._old_state = [p.detach().clone() for p in self.trainable_parameters()]

    @property
    def has_old_policy(self) -> bool:
        """Whether an old policy is kept (``use_forward_process(old_decay=...)``); without one the old weights are
        the current ones."""
        return self._old_state is not None

    @contextlib.contextmanager
    def _old_weights(self) -> Iterator[None]:
        """The old policy's weights swapped into the trainable parameters for the duration (no gradient may be
        taken inside: the same parameters hold them); the current weights when there is no old policy."""
        if self._old_state is None:
            yield
            return
        params = list(self.trainable_parameters())
        current = [p.data for p in params]
        for p, old in zip(params, self._old_state):
            p.data = old
        try:
            yield
        finally:
            for p, data in zip(params, current):
                p.data = data

    @torch.no_grad()
    def after_optimizer_step(self, step: int) -> None:
        """Trainer hook after optimizer step ``step`` (1-based): old <- decay(step) old + (1 - decay(step)) theta."""
        if self._old_state is None or self.old_decay is None:
            return
        decay = float(self.old_decay(step))
        for old, p in zip(self._old_state, self.trainable_parameters()):
            old.mul_(decay).add_(p.detach().to(old.dtype), alpha=1.0 - decay)

    def state_tensors(self) -> dict[str, Tensor]:
        """Training state beyond the weights and optimizer that a checkpoint must carry (the old policy)."""
        return {f"old.{i}": t for i, t in enumerate(self._old_state or [])}

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        if self._old_state is None:
            return
        for i, old in enumerate(self._old_state):
            old.copy_(tensors[f"old.{i}"])

    # ------------------------------------------------------------------ preference pairs
    def _pixel_multiple(self) -> int:
        """Image sizes must be multiples of this (the VAE factor; x2 where latents are packed 2x2)."""
        return self.vae_scale_factor

    def _side_cond(self, sizes: tuple, crops: tuple, resolution: int) -> dict[str, Tensor]:
        """Extra per-side conditioning of preference images from their original sizes and crops (none here)."""
        return {}

    @torch.no_grad()
    def preference_batch(self, rows: list[dict[str, Any]], resolution: int | None = None) -> PreferenceBatch:
        """Pairs from ``unialign.image.data.normalize_pickapic`` (``prompt``; ``chosen`` / ``rejected``: encoded
        ``EncodedImage``s, decoded here one at a time by ``to_pixels``, or PIL images)
        -> a ``PreferenceBatch``: each image resized / centre-cropped to ``resolution`` (default: the policy's
        height), VAE-encoded (posterior sample, fp32, ``encode_images``) into ``chosen["latents"]`` /
        ``rejected["latents"]`` [B, C, H, W] with the family's per-side conditioning (SDXL ``time_ids`` from
        each image's real original size and crop); ONE training time and ONE noise per pair in ``payload``
        (shared by chosen, rejected, policy and reference); the prompt embeddings, each caption replaced by ""
        with probability ``caption_dropout`` while the denoiser is in training mode (keeps classifier-free
        guidance usable)."""
        from diffusers.utils.torch_utils import randn_tensor

        from unialign.image.data import to_pixels

        res = resolution or self.height
        multiple = self._pixel_multiple()
        if res % multiple:
            raise ValueError(f"resolution {res} must be a multiple of {multiple} for {type(self).__name__}")
        captions = [r["prompt"] for r in rows]
        if self.caption_dropout and self.denoiser.training:
            drop = torch.rand(len(rows), generator=self.generator) < self.caption_dropout
            captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
        sides = []
        for key in ("chosen", "rejected"):
            pix, sizes, crops = zip(*(to_pixels(r[key], res) for r in rows))
            latents = self.encode_images(torch.stack(pix), generator=self.generator)
            sides.append({"latents": latents, **self._side_cond(sizes, crops, res)})
        payload = {**self._draw_pair_times(len(rows)),
                   "noise": randn_tensor(tuple(sides[0]["latents"].shape), generator=self.generator,
                                         dtype=torch.float32),
                   **self.encode_prompts(captions)}
        return PreferenceBatch(prompts=captions, chosen=sides[0], rejected=sides[1], payload=payload)

    def sequence_log_prob(self, batch: PreferenceBatch, length_normalize: bool = False) -> tuple[Tensor, Tensor]:
        """Diffusion-DPO ELBO **surrogate** (Wallace et al. 2023, eq. 14 as implemented in
        SalesforceAIResearch/DiffusionDPO ``train.py``), NOT the log-likelihood of the image:

            logp = -1/2 * mean_CHW || model(x_t, t, c) - target ||^2

        with the family's forward noising and target (``_noised``: eps / v / x0 for a UNet at
        x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps; eps - x0 for rectified flow at x_t = (1 - sigma) x0 + sigma eps).
        One training time and one eps per pair shared by the chosen and rejected latents (identical images
        give identical values), both sides in one doubled call, no CFG. Reads ``batch.chosen["latents"]`` /
        ``batch.rejected["latents"]`` [B, C, H, W] (``encode_images``), optionally the payload's times
        (``_pair_times``; else drawn from the policy's generator), ``["noise"]`` [B, C, H, W] (else drawn),
        the prompt embeddings (``text_keys``; else the prompts are encoded) and per-side conditioning.
        ``length_normalize`` is ignored (already a mean). Returns (chosen_B, rejected_B)."""
        return self._sequence_log_prob(self.model, batch, length_normalize)

    def _sequence_log_prob(self, model, batch: PreferenceBatch, length_normalize: bool = False) -> tuple[Tensor, Tensor]:
        from diffusers.utils.torch_utils import randn_tensor

        chosen = batch.chosen["latents"].to(self.device, torch.float32)
        rejected = batch.rejected["latents"].to(self.device, torch.float32)
        b = chosen.shape[0]
        times = self._pair_times(batch.payload, b)
        noise = batch.payload.get("noise")
        if noise is None:
            noise = randn_tensor(chosen.shape, generator=self.generator, dtype=torch.float32)
        noise = noise.to(self.device, torch.float32)
        if all(k in batch.payload for k in self.text_keys):
            cond = {k: batch.payload[k].to(self.device, self.dtype) for k in self.text_keys}
        else:
            cond = self.encode_prompts(batch.prompts)
        cond = {k: torch.cat([v, v]) for k, v in cond.items()}
        cond.update(self._pair_side_cond(batch, chosen.shape))
        x_t, t2, target = self._noised(torch.cat([chosen, rejected]), torch.cat([noise, noise]), times)
        pred = self._denoise(model, x_t, t2, cond, False).float()
        logp = -0.5 * ((pred - target.float()) ** 2).mean(dim=tuple(range(1, target.dim())))
        return logp[:b], logp[b:]

    def _pair_side_cond(self, batch: PreferenceBatch, latent_shape: torch.Size) -> dict[str, Tensor]:
        """Per-side conditioning of a pair batch, chosen rows then rejected rows (none here)."""
        return {}

    # ------------------------------------------------------------------ reference and saving
    @contextlib.contextmanager
    def _adapters_disabled(self) -> Iterator[None]:
        self.denoiser.disable_adapters()
        try:
            yield
        finally:
            self.denoiser.enable_adapters()

    def generators(self) -> dict[str, torch.Generator]:
        """The policy's own generator (``seed=``: the timesteps, noise, caption dropout and VAE posterior draws of
        ``preference_batch`` and the flow policies' training timesteps), for checkpoints to save and restore."""
        return {"generator": self.generator}

    def reference(self) -> ReferencePolicy:
        """The frozen reference: the same denoiser with LoRA adapters disabled, or (full fine-tuning) a frozen
        deep copy made on the first call; call it before training starts."""
        if self.lora_rank > 0:
            return ReferencePolicy(self, None, self._adapters_disabled)  # the policy's own (wrapped) denoiser
        if self._frozen_denoiser is None:
            self._frozen_denoiser = copy.deepcopy(self.denoiser).requires_grad_(False).eval()
        return ReferencePolicy(self, self._frozen_denoiser)

    def _lora_layers(self, peft_state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The LoRA state dict in the form the stock pipeline's ``save_lora_weights`` takes."""
        return peft_state

    def _pipeline_components(self) -> dict[str, Any]:
        """The stock pipeline's (``_pipeline_class``) constructor arguments from this policy: the trained denoiser
        under its name (``unet`` / ``transformer``), every other component the class takes read from the
        policy's attribute of the same name (``vae``, ``text_encoder[_2/_3]``, ``tokenizer[_2/_3]``,
        ``scheduler``: the parts as the run loaded and used them), None for a component the policy does not
        hold (SD1.x's ``safety_checker`` / ``feature_extractor``, SD3 without T5, IP-adapter image encoders),
        ``requires_safety_checker=False`` and the policy's ``force_zeros_for_empty_prompt`` (SDXL)."""
        import inspect

        cls = self._pipeline_class()
        out: dict[str, Any] = {}
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if name == self.denoiser_subfolder:
                out[name] = self.denoiser
            elif name == "requires_safety_checker":
                out[name] = False
            elif name == "force_zeros_for_empty_prompt":
                out[name] = self.force_zeros_for_empty_prompt
            elif param.default is inspect.Parameter.empty or name in getattr(cls, "_optional_components", ()):
                out[name] = getattr(self, name, None)
        return out

    def _absent_components(self) -> list[str]:
        """Components the stock pipeline requires but this policy does not have (SD3 without T5:
        ``text_encoder_3``, ``tokenizer_3``): stock ``from_pretrained`` of a folder without them refuses to load
        unless each is passed as None, as for the source folder."""
        cls = self._pipeline_class()
        optional = set(getattr(cls, "_optional_components", ()))
        return [n for n, v in self._pipeline_components().items() if v is None and n not in optional]

    def sampling_settings(self) -> dict[str, Any]:
        """The stock pipeline's call arguments this policy samples with (steps, guidance, size): the stock
        defaults (50 steps, guidance 7, the model's default size) draw something else, for the embedded models a
        malformed image. ``save`` writes them to ``sampling.json`` and ``load_snippet`` passes them."""
        return {"num_inference_steps": int(self.num_steps), "guidance_scale": float(self.guidance_scale),
                "height": int(self.height), "width": int(getattr(self, "width", None) or self.height)}

    def load_snippet(self, path: str, base: str | None = None) -> str:
        """Three lines of Python that load what ``save(path)`` wrote -- the pipeline folder (full fine-tuning; with
        ``<name>=None`` for each ``_absent_components``), or ``base`` (the hub id / folder the run loaded; a
        placeholder when None) with the LoRA on top -- and sample as the run did (``sampling_settings``)."""
        cls = self._pipeline_class().__name__
        absent = "".join(f", {name}=None" for name in self._absent_components())
        call = ", ".join(f"{k}={v!r}" for k, v in self.sampling_settings().items())
        one, field = self.output_kind
        sample = f"\n{one} = pipe('a prompt', {call}).{field}[0]"
        if self.lora_rank == 0:
            return (f"from diffusers import DiffusionPipeline\n"
                    f"pipe = DiffusionPipeline.from_pretrained({str(path)!r}{absent}){sample}")
        return (f"from diffusers import {cls}\npipe = {cls}.from_pretrained({base or '<the base model>'!r}{absent}); "
                f"pipe.load_lora_weights({str(path)!r}){sample}")

    def save(self, path: str) -> None:
        """Full fine-tuning (``lora_rank=0``): a whole diffusers pipeline folder in ``path`` -- the stock pipeline
        (``_pipeline_class``: ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline`` /
        ``StableDiffusion3Pipeline`` / ``FluxPipeline``) built from ``_pipeline_components`` (the trained denoiser
        with the VAE, text encoders, tokenizers and scheduler as the run loaded them) and written with
        ``save_pretrained(safe_serialization=True)``, plus a ``README.md`` saying how to load it. So
        ``DiffusionPipeline.from_pretrained(path)`` (or the class's own) samples with the trained weights, the
        denoiser alone still loads from ``path/<denoiser_subfolder>``, and the policies' ``from_pretrained(path)``
        continue from it. What differs from the source folder: the scheduler is the one the policy samples with
        (SD1.x / SDXL: a ``DDIMScheduler`` with the source's config), SD1.x has no safety checker
        (``requires_safety_checker`` false; the policy never loads one), SD3 without T5 stays without it -- stock
        diffusers then needs ``text_encoder_3=None, tokenizer_3=None`` passed to ``from_pretrained``, as for the
        source folder (``load_snippet`` says so). The embedded shapes-world models are stock diffusers classes
        throughout (no custom component), so their saved pipelines load with stock diffusers too.

        LoRA: ``pytorch_lora_weights.safetensors`` in ``path`` (the stock pipeline's ``save_lora_weights``),
        loadable with its stock ``load_lora_weights(path)``. Called on every process; the main process writes."""
        from unialign.dist import is_main_rank

        if not is_main_rank():
            return
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "sampling.json"), "w", encoding="utf-8") as f:  # how the run sampled
            json.dump(self.sampling_settings(), f, indent=1)
        if self.lora_rank == 0:
            self._pipeline_class()(**self._pipeline_components()).save_pretrained(path, safe_serialization=True)
            with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as f:
                f.write(f"# Fine-tuned {self._pipeline_class().__name__} (unialign, full fine-tuning)\n\n"
                        "A complete diffusers pipeline folder; load it with (this folder's path):\n\n```python\n"
                        f"{self.load_snippet('path/to/this/folder')}\n```\n")
            return
        from peft.utils import get_peft_model_state_dict

        layers = self._lora_layers(get_peft_model_state_dict(self.denoiser))
        metadata = self.denoiser.peft_config["default"].to_dict()
        metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
        name = self.denoiser_subfolder
        self._pipeline_class().save_lora_weights(path, **{f"{name}_lora_layers": layers,
                                                          f"{name}_lora_adapter_metadata": metadata})


def to_uint8_frames(pixels: Tensor) -> list[Image.Image]:
    """Decoded pixels [B, 3, H, W] in [-1, 1] -> B PIL images (rounded to uint8, as the stock image processors)."""
    arr = ((pixels / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in arr]


@torch.no_grad()
def decode_images(vae, latents_B_C_H_W: Tensor) -> list[Image.Image]:
    """VAE-decode (fp32) latents to PIL images: latents / scaling_factor (+ shift_factor where the VAE has one: SD3,
    FLUX), as the stock pipelines."""
    z = latents_B_C_H_W.float() / vae.config.scaling_factor
    if getattr(vae.config, "shift_factor", None):
        z = z + vae.config.shift_factor
    return to_uint8_frames(vae.decode(z).sample)


@torch.no_grad()
def encode_images(vae, pixels_B_3_H_W: Tensor, sample_posterior: bool = True,
                  generator: torch.Generator | None = None) -> Tensor:
    """Pixels in [-1, 1] -> latents (z - shift_factor) x scaling_factor [B, C, H, W] (VAE in fp32; no shift for
    SD1.x / SDXL), the stock training convention. ``sample_posterior=True`` draws from the VAE posterior as
    Diffusion-DPO does; False takes its mean (deterministic)."""
    dist = vae.encode(pixels_B_3_H_W.to(torch.float32)).latent_dist
    z = dist.sample(generator) if sample_posterior else dist.mean
    if getattr(vae.config, "shift_factor", None):
        z = z - vae.config.shift_factor
    return z * vae.config.scaling_factor


def print_load_snippet(acc, policy: DenoiserPolicy, final: str | os.PathLike) -> None:
    """Print (main process) how to load ``final`` (what ``policy.save`` wrote there): ``policy.load_snippet``
    with the base model a LoRA goes on read from the denoiser's config (``_name_or_path``: the hub id or folder
    it was loaded from)."""
    from pathlib import Path

    if not Path(final).exists():  # nothing was written (an interrupted run)
        return
    base = getattr(policy.denoiser, "config", {}).get("_name_or_path") or None
    acc.print(f"load the trained model:\n{policy.load_snippet(str(Path(final).resolve()), base)}")
