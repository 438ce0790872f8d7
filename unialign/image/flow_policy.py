"""Flow-matching policies behind the ``Policy`` protocol: ``FlowPolicyBase`` (what every
flow-matching family shares) and ``FlowMatchingPolicy`` (the SD3 family, Stable Diffusion 3 / 3.5).
``unialign.image.flux_policy.FluxPolicy`` (FLUX.1) is the other family on the same base.

A trajectory is the N steps x_1 -> ... -> x_0 of diffusers' ``FlowMatchEulerDiscreteScheduler`` made
stochastic by Flow-GRPO's SDE step (``unialign.image.flow.sde_step_with_logprob``, "sde" or "cps"); the
per-step log-prob is that step's Gaussian log-density averaged over C,H,W (the DDPO convention of
``DiffusionPolicy``). With an SDE window (Flow-GRPO-Fast / MixGRPO) only the steps inside the window are
stochastic and trained (``mask_B_T`` 1); the others are deterministic Euler steps x + v dt (mask 0, log-prob 0).
A step of std 0 (the last "cps" step) is deterministic too: mask 0, as Flow-GRPO never trains its last step.
The transformer (``self.model``) is the only trainable module; VAE and text encoders are frozen.

``FlowPolicyBase`` is the flow-matching step on the shared denoiser part (``unialign.image.denoiser``:
sampling, the step log-probs, the KL to the reference, the Diffusion-DPO surrogate, the reference and saving
are written once there). A family is a small adapter over it: ``encode_prompts`` (the conditioning dict),
``_denoise`` (the velocity: one transformer call with CFG, packing, guidance embedding), ``_latent_shape``,
``_set_timesteps`` (the sampling sigmas), ``_pipeline_class`` (the stock pipeline whose
``save_lora_weights`` writes the LoRA) and ``from_pretrained``.

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

from dataclasses import replace
from typing import Any

import torch

from unialign.image.denoiser import DenoiserPolicy
from unialign.image.families import SamplerKnobs
from unialign.image.kernels import FlowSDEKernel
from unialign.types import Trajectory

Tensor = torch.Tensor

# the attention projections of SD3's joint blocks (diffusers' train_dreambooth_lora_sd3.py default)
SD3_LORA_TARGET_MODULES = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
COND_KEYS = ("prompt_embeds", "pooled_prompt_embeds")


class FlowPolicyBase(DenoiserPolicy):
    """The flow-matching step on the shared denoiser part (``DenoiserPolicy``: module docstring); a family
    implements ``encode_prompts``, ``_denoise`` (the velocity), ``_latent_shape``, ``_set_timesteps``,
    ``_pipeline_class`` and ``from_pretrained``, and calls ``_setup_flow`` from its constructor."""

    family = "flow"
    denoiser_subfolder = "transformer"
    cond_keys = text_keys = COND_KEYS

    def _setup_flow(self, transformer, vae, scheduler, frozen: tuple, knobs: SamplerKnobs, *, lora_rank: int,
                    lora_alpha: float | None, target_modules: list[str], gradient_checkpointing: bool,
                    sample_batch_size: int, train_chunk_size: int, seed: int, caption_dropout: float) -> None:
        """The shared set-up; ``knobs``: the sampler knobs, every flow one set (height and width resolved)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.knobs = knobs
        num_steps, height, width = knobs.num_steps, knobs.height, knobs.width
        kernel = FlowSDEKernel(num_steps, knobs.noise_level, knobs.sde_type, knobs.sde_window_size,
                               knobs.sde_window_range)
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1], got {caption_dropout}")
        self.transformer = transformer
        self.vae = vae if vae.dtype == torch.float32 else vae.to(torch.float32)
        self.scheduler = (scheduler if isinstance(scheduler, FlowMatchEulerDiscreteScheduler)
                          else FlowMatchEulerDiscreteScheduler.from_config(scheduler.config))
        # the training timesteps / sigmas (num_train_timesteps of them, before set_timesteps), as the
        # diffusers training scripts' ``noise_scheduler_copy``: the Diffusion-DPO surrogate draws from them
        train = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)
        self.train_timesteps = train.timesteps.detach().float().cpu()
        self.train_sigmas = train.sigmas.detach().float().cpu()[: len(self.train_timesteps)]
        self.num_steps, self.guidance_scale = num_steps, knobs.guidance_scale
        self.kernel = kernel
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.height, self.width = height, width
        multiple = self._pixel_multiple()
        if height % multiple or width % multiple:
            raise ValueError(f"height and width (--resolution) must be multiples of {multiple} for {type(self).__name__} "
                             f"(the VAE factor {self.vae_scale_factor} x the transformer's "
                             f"{multiple // self.vae_scale_factor}x{multiple // self.vae_scale_factor} patches), "
                             f"got {height} x {width}")
        self.max_sequence_length = knobs.max_sequence_length
        self.generator = torch.Generator().manual_seed(seed)
        self.caption_dropout = caption_dropout
        self._set_timesteps()
        self._setup_denoiser(transformer, (self.vae, *frozen), lora_rank=lora_rank, lora_alpha=lora_alpha,
                             target_modules=target_modules, gradient_checkpointing=gradient_checkpointing,
                             sample_batch_size=sample_batch_size, train_chunk_size=train_chunk_size)

    # ------------------------------------------------------------------ family hooks
    def encode_prompts(self, prompts: list[str]) -> dict[str, Tensor]:
        """``prompt_embeds`` [B, L, D] and ``pooled_prompt_embeds`` [B, P] (no grad)."""
        raise NotImplementedError

    def _denoise(self, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor], cfg: bool = True) -> Tensor:
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

    # ------------------------------------------------------------------ the SDE step kernel's knobs
    @property
    def noise_level(self) -> float:
        return self.kernel.noise_level

    @property
    def sde_type(self) -> str:
        return self.kernel.sde_type

    @property
    def sde_window_size(self) -> int:
        return self.kernel.sde_window_size

    @property
    def sde_window_range(self) -> tuple[int, int]:
        return self.kernel.sde_window_range

    def sde_window(self, generator: torch.Generator | None = None) -> tuple[int, int]:
        """[start, end) of the stochastic, trained steps (the kernel's ``window``)."""
        return self.kernel.window(generator)

    def kl_weights(self, trajectory: Trajectory) -> Tensor:
        """[B, T] std^2 / g^2 of each step, the kernel's: |dt| for the SDE step, 1 for CPS (``gaussian_g2``)."""
        return self.kernel.kl_weights(self, trajectory)

    def draw_training_timesteps(self, batch: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """(timesteps [B], sigmas [B]) float32 drawn uniformly over the scheduler's ``num_train_timesteps``
        training timesteps: diffusers' train_dreambooth_sd3.py / train_dreambooth_lora_flux.py with
        ``weighting_scheme="none"`` (u ~ U[0, 1), index = int(u T), timestep and sigma of
        ``noise_scheduler_copy`` at that index), the flow-matching form of Diffusion-DPO's t ~ U{0..T-1}
        (Wallace et al. 2023)."""
        index = torch.randint(0, len(self.train_timesteps), (batch,), generator=generator or self.generator)
        return self.train_timesteps[index], self.train_sigmas[index]

    # ------------------------------------------------------------------ what the step kernel reads
    def _sampling_cond(self, prompts: list[Any]) -> dict[str, Tensor]:
        return self.encode_prompts(prompts)

    def _initial_latents(self, batch: int, generator: torch.Generator | None) -> Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor(self._latent_shape(batch), generator=generator, device=self.device, dtype=torch.float32)

    # ------------------------------------------------------------------ the forward process
    is_flow_matching = True

    def _forward_process(self, x0: Tensor, eps: Tensor, t_R: Tensor) -> dict[str, Tensor]:
        """x_t = (1 - sigma) x0 + sigma eps at scheduler timesteps ``t_R`` [R] (sigma = t / num_train_timesteps, as
        ``FlowMatchEulerDiscreteScheduler`` sets them), the rectified-flow target eps - x0, alpha = 1 - sigma and
        sigma [R]."""
        sigma = t_R.float().to(self.device) / self.scheduler.config.num_train_timesteps
        s = sigma.view(-1, *([1] * (x0.dim() - 1)))
        return {"x_t": (1 - s) * x0 + s * eps, "target": eps.float() - x0.float(), "alpha": 1 - sigma, "sigma": sigma}

    def _x0_from(self, pred: Tensor, p: dict[str, Tensor]) -> Tensor:
        """x0 = x_t - sigma v."""
        return p["x_t"].float() - p["sigma"].view(-1, *([1] * (pred.dim() - 1))) * pred

    # ------------------------------------------------------------------ Diffusion-DPO pairs (hooks)
    def _draw_pair_times(self, batch: int) -> dict[str, Tensor]:
        timesteps, sigmas = self.draw_training_timesteps(batch)
        return {"timesteps": timesteps, "sigmas": sigmas}

    def _pair_times(self, payload: dict[str, Any], batch: int) -> tuple[Tensor, Tensor]:
        """(t [B], sigma [B]) of the payload, drawn when missing (``draw_training_timesteps``); sigma =
        t / num_train_timesteps when only t is given."""
        t_B, sigma_B = payload.get("timesteps"), payload.get("sigmas")
        if t_B is None:
            t_B, sigma_B = self.draw_training_timesteps(batch)
        elif sigma_B is None:
            sigma_B = torch.as_tensor(t_B, dtype=torch.float32) / self.scheduler.config.num_train_timesteps
        return (torch.as_tensor(t_B, dtype=torch.float32).to(self.device),
                torch.as_tensor(sigma_B, dtype=torch.float32).to(self.device))

    def _noised(self, x0: Tensor, eps: Tensor, times: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """x_t = (1 - sigma) x0 + sigma eps and the rectified-flow target velocity eps - x0 (the flow-matching
        loss of SD3 / FLUX: diffusers' train_dreambooth_sd3.py, target = noise - model_input, uniform
        weighting), for the doubled batch."""
        t_B, sigma_B = times
        sigma = torch.cat([sigma_B, sigma_B]).view(-1, *([1] * (x0.dim() - 1)))
        return (1 - sigma) * x0 + sigma * eps, torch.cat([t_B, t_B]), eps.float() - x0.float()


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
            ``save`` (``DenoiserPolicy.save``): the LoRA in ``load_lora_weights`` form, or a whole
            ``StableDiffusion3Pipeline`` folder (without T5 when the policy has none).
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
        knobs: the sampler knobs as one frozen value (``unialign.image.families.SamplerKnobs``); its set fields
            replace the keywords of the same name (``self.knobs``: the values used).
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
        knobs: SamplerKnobs | None = None,
    ) -> None:
        if (text_encoder_3 is None) != (tokenizer_3 is None):
            raise ValueError("text_encoder_3 and tokenizer_3 go together (both None: no T5, zeros as the stock pipeline)")
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        self.text_encoder_3, self.tokenizer_3 = text_encoder_3, tokenizer_3
        k = SamplerKnobs.over(knobs, num_steps=num_steps, guidance_scale=guidance_scale, noise_level=noise_level,
                              sde_type=sde_type, sde_window_size=sde_window_size, sde_window_range=sde_window_range,
                              height=height, width=width, max_sequence_length=max_sequence_length)
        default = transformer.config.sample_size * 2 ** (len(vae.config.block_out_channels) - 1)
        self._setup_flow(transformer, vae, scheduler, (text_encoder, text_encoder_2, text_encoder_3),
                         replace(k, height=k.height or default, width=k.width or default), lora_rank=lora_rank,
                         lora_alpha=lora_alpha, target_modules=SD3_LORA_TARGET_MODULES,
                         gradient_checkpointing=gradient_checkpointing, sample_batch_size=sample_batch_size,
                         train_chunk_size=train_chunk_size, seed=seed, caption_dropout=caption_dropout)
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

    def _pixel_multiple(self) -> int:
        return self.vae_scale_factor * self.transformer.config.patch_size

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

    def _denoise(self, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor], cfg: bool = True) -> Tensor:
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
