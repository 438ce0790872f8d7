"""``FluxPolicy``: FLUX.1 (dev / schnell) behind the ``Policy`` protocol, a small adapter over
``FlowPolicyBase`` (sampling, step log-probs, KL, the Diffusion-DPO surrogate, reference and saving are the
shared ``unialign.image.denoiser.DenoiserPolicy``'s; ``unialign.image.flow_policy`` explains the SDE step and
the payload).

What differs from SD3, restated from diffusers' ``FluxPipeline`` (pipelines/flux/pipeline_flux.py):

* conditioning: ``pooled_prompt_embeds`` = the pooled output of CLIP (``CLIPTextModel``, ``tokenizer``
  padded to its model_max_length) [B, P]; ``prompt_embeds`` = T5's last hidden state (``text_encoder_2`` /
  ``tokenizer_2`` padded to ``max_sequence_length``) [B, L, D]. ``txt_ids`` are zeros [L, 3] and
  ``img_ids`` the (0, row, column) of each 2x2 latent patch [HW/4, 3] (``_prepare_latent_image_ids``).
* the transformer sees latents packed 2x2 into tokens [B, HW/4, 4C] (``pack_latents``) and returns tokens
  (``unpack_latents``); trajectories stay UNPACKED [B, N+1, C, H, W], so the step kernel's mean over C,H,W
  and ``decode`` are the same as SD3's (a mean over tokens x features is the same mean).
* timestep / 1000 goes to the transformer; no CFG (no doubled batch): FLUX-dev's distilled guidance is the
  ``guidance`` embedding, a tensor [B] filled with ``guidance_scale`` (None for a transformer without
  ``guidance_embeds``, FLUX-schnell).
* sigmas ``np.linspace(1, 1/N, N)`` shifted by ``mu = calculate_shift(image tokens, ...)`` (dynamic shift).
* VAE: decode z / scaling_factor + shift_factor, encode (z - shift_factor) x scaling_factor (the base's).

The DPO surrogate (``sequence_log_prob``) feeds the guidance embedding at the policy's ``guidance_scale``,
not 1.0: FLUX-dev's velocity is only defined together with a guidance value, the policy samples (and so is
trained online) at that value, and diffusers' train_dreambooth_lora_flux.py trains with the guidance
embedding at its ``--guidance_scale`` (3.5, the stock sampling default) -- the surrogate then scores the very
velocity field the policy samples with.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from unialign.image.families import SamplerKnobs
from unialign.image.flow_policy import FlowPolicyBase

Tensor = torch.Tensor

# diffusers' train_dreambooth_lora_flux.py default ``target_modules`` (attention projections of the double
# and single blocks -- the single blocks have to_q/k/v only -- and the double blocks' feed-forwards)
FLUX_LORA_TARGET_MODULES = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
                            "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                            "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline.default_sample_size (latent pixels): 1024 px with the FLUX VAE


def pack_latents(latents_B_C_H_W: Tensor) -> Tensor:
    """[B, C, H, W] -> tokens [B, (H/2)(W/2), 4C]: each 2x2 patch one token, features ordered (c, dy, dx)
    (``FluxPipeline._pack_latents``)."""
    b, c, h, w = latents_B_C_H_W.shape
    x = latents_B_C_H_W.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens_B_L_F: Tensor, height: int, width: int) -> Tensor:
    """Inverse of ``pack_latents``: tokens [B, (H/2)(W/2), 4C] -> [B, C, H, W] (H, W in latent pixels)."""
    b, _, f = tokens_B_L_F.shape
    x = tokens_B_L_F.view(b, height // 2, width // 2, f // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, f // 4, height, width)


def latent_image_ids(height: int, width: int, device=None, dtype=torch.float32) -> Tensor:
    """[(H/2)(W/2), 3]: (0, row, column) of each packed token (H, W in latent pixels), row-major."""
    rows = torch.arange(height // 2).repeat_interleave(width // 2)
    cols = torch.arange(width // 2).repeat(height // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).to(device=device, dtype=dtype)


class FluxPolicy(FlowPolicyBase):
    """FLUX.1 policy sampling with Flow-GRPO's stochastic step (module docstring for the FLUX specifics).

    Args:
        transformer: ``FluxTransformer2DModel``.  vae: ``AutoencoderKL`` (fp32; needs ``shift_factor``).
        text_encoder, tokenizer: CLIP (``CLIPTextModel``: its pooled output).  text_encoder_2, tokenizer_2:
            T5 (``T5EncoderModel``: its last hidden state; the tokenizer is only called).
        scheduler: a ``FlowMatchEulerDiscreteScheduler`` (any other is converted with the same config).
        num_steps: N sampling steps.  guidance_scale: the distilled guidance embedding (FLUX-dev; stock
            default 3.5); ignored for a transformer without ``guidance_embeds``. Never CFG.
        noise_level, sde_type, sde_window_size, sde_window_range, lora_alpha, gradient_checkpointing,
            sample_batch_size, train_chunk_size, seed, caption_dropout, knobs: as ``FlowMatchingPolicy``.
        cfg_uncond_grad: accepted for the image scripts' one interface; FLUX-dev has no CFG to detach.
        height, width: image size in pixels, multiples of 2 x the VAE factor (default: the stock pipeline's
            128 x VAE factor = 1024).
        max_sequence_length: T5 tokens (stock default 512).
        lora_rank: > 0 adds a peft LoRA on ``FLUX_LORA_TARGET_MODULES`` and freezes the base; 0 trains the
            full transformer. ``save``: the LoRA with ``FluxPipeline.save_lora_weights``, a full fine-tune as a
            whole ``FluxPipeline`` folder (``DenoiserPolicy.save``).
    """

    family = "flux"

    def __init__(
        self,
        transformer,
        vae,
        text_encoder,
        tokenizer,
        text_encoder_2,
        tokenizer_2,
        scheduler,
        *,
        num_steps: int = 10,
        guidance_scale: float = 3.5,
        noise_level: float = 0.7,
        sde_type: str = "sde",
        sde_window_size: int = 0,
        sde_window_range: tuple[int, int] | None = None,
        height: int | None = None,
        width: int | None = None,
        max_sequence_length: int = 512,
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
        if getattr(vae.config, "shift_factor", None) is None:
            raise ValueError("FluxPolicy needs a VAE with shift_factor in its config (FLUX's AutoencoderKL has one)")
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        k = SamplerKnobs.over(knobs, num_steps=num_steps, guidance_scale=guidance_scale, noise_level=noise_level,
                              sde_type=sde_type, sde_window_size=sde_window_size, sde_window_range=sde_window_range,
                              height=height, width=width, max_sequence_length=max_sequence_length)
        default = DEFAULT_SAMPLE_SIZE * 2 ** (len(vae.config.block_out_channels) - 1)
        self._setup_flow(transformer, vae, scheduler, (text_encoder, text_encoder_2),
                         replace(k, height=k.height or default, width=k.width or default), lora_rank=lora_rank,
                         lora_alpha=lora_alpha, target_modules=FLUX_LORA_TARGET_MODULES,
                         gradient_checkpointing=gradient_checkpointing, sample_batch_size=sample_batch_size,
                         train_chunk_size=train_chunk_size, seed=seed, caption_dropout=caption_dropout)
        self.cfg_uncond_grad = cfg_uncond_grad  # no CFG in FLUX: kept for the one interface of the image policies

    # ------------------------------------------------------------------ family hooks
    def _latent_shape(self, batch: int) -> tuple[int, int, int, int]:
        """(B, in_channels / 4, H, W): ``FluxPipeline.prepare_latents`` before packing."""
        scale = self.vae_scale_factor
        return (batch, self.transformer.config.in_channels // 4, 2 * (self.height // (scale * 2)),
                2 * (self.width // (scale * 2)))

    def _pixel_multiple(self) -> int:
        return 2 * self.vae_scale_factor  # latents packed 2x2 into the transformer's tokens

    def _set_timesteps(self) -> None:
        """``FluxPipeline``: sigmas linspace(1, 1/N, N) (None with ``use_flow_sigmas``) and the dynamic shift
        mu = ``calculate_shift`` of the packed image sequence length."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        _, _, h, w = self._latent_shape(1)
        mu = calculate_shift((h // 2) * (w // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / self.num_steps, self.num_steps)
        if sigmas is None:
            self.scheduler.set_timesteps(self.num_steps, mu=mu)
        else:
            self.scheduler.set_timesteps(sigmas=sigmas, mu=mu)

    @classmethod
    def _pipeline_class(cls):
        from diffusers import FluxPipeline

        return FluxPipeline

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, Tensor]:
        """``FluxPipeline.encode_prompt`` (one image per prompt): ``prompt_embeds`` [B, max_sequence_length,
        D_T5] (T5's last hidden state) and ``pooled_prompt_embeds`` [B, D_CLIP] (CLIP's pooled output)."""
        prompts = list(prompts)
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids.to(self.device)
        pooled = self.text_encoder(ids, output_hidden_states=False).pooler_output
        ids_2 = self.tokenizer_2(prompts, padding="max_length", max_length=self.max_sequence_length,
                                 truncation=True, return_tensors="pt").input_ids.to(self.device)
        embeds = self.text_encoder_2(ids_2, output_hidden_states=False)[0]
        return {"prompt_embeds": embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)}

    def _denoise(self, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor], cfg: bool = True) -> Tensor:
        """Velocity v [B, C, H, W] of ``model`` at unpacked ``latents`` and scheduler timesteps ``t_B`` [B]:
        one call on the packed tokens with timestep / 1000, zero ``txt_ids``, ``img_ids`` and the guidance
        embedding (``guidance_scale``, whatever ``cfg`` says: FLUX has no CFG to turn off)."""
        b, _, h, w = latents.shape
        x = pack_latents(latents.to(self.dtype))
        embeds = cond["prompt_embeds"]
        guidance = (torch.full((b,), float(self.guidance_scale), device=x.device, dtype=torch.float32)
                    if self.transformer.config.guidance_embeds else None)
        out = model(hidden_states=x, timestep=t_B.to(x.device, x.dtype) / 1000, guidance=guidance,
                    pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=embeds,
                    txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=embeds.dtype),
                    img_ids=latent_image_ids(h, w, x.device, x.dtype), return_dict=False)[0]
        return unpack_latents(out, h, w)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, lora_rank: int = 0, torch_dtype: torch.dtype | str | None = None,
                        device: str | torch.device | None = None, variant: str | None = None,
                        **kwargs: Any) -> FluxPolicy:
        """Load the parts of a diffusers ``FluxPipeline`` folder or hub id (e.g. black-forest-labs/FLUX.1-dev);
        ``kwargs`` go to the constructor. Fails at once with a RuntimeError when the weights are neither local
        nor downloadable (offline, unknown id, no network)."""

        def build(opts: dict, model_kw: dict) -> dict[str, Any]:
            from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
            from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel

            return {
                "transformer": FluxTransformer2DModel.from_pretrained(path_or_hub_id, subfolder="transformer",
                                                                      **model_kw),
                "vae": AutoencoderKL.from_pretrained(path_or_hub_id, subfolder="vae", **opts),
                "text_encoder": CLIPTextModel.from_pretrained(path_or_hub_id, subfolder="text_encoder", **model_kw),
                "tokenizer": CLIPTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer", **opts),
                "text_encoder_2": T5EncoderModel.from_pretrained(path_or_hub_id, subfolder="text_encoder_2", **model_kw),
                "tokenizer_2": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_2", **opts),
                "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(path_or_hub_id, subfolder="scheduler",
                                                                             **opts),
            }

        layout = ("FluxPipeline (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, text_encoder_2/, "
                  "tokenizer_2/, scheduler/)")
        parts = cls._load_parts(path_or_hub_id, build, "FLUX", layout, torch_dtype, variant, device)
        return cls(**parts, lora_rank=lora_rank, **kwargs)
