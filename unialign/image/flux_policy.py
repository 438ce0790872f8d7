"""FLUX.1 (dev / schnell) behind the ``Policy`` protocol: the adapter ``FluxFamily`` (a
``unialign.image.flow_policy.FlowFamily``) and ``FluxPolicy``, the flow policy ``FlowPolicyBase`` with it
(sampling, step log-probs, KL, the Diffusion-DPO surrogate, reference and saving are the shared
``unialign.image.denoiser.DenoiserPolicy``'s; ``unialign.image.flow_policy`` explains the SDE step and the payload).

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

from typing import Any

import numpy as np
import torch

from unialign.image.flow_policy import FlowFamily, FlowPolicyBase

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


def flux_sigmas(num_steps: int) -> np.ndarray:
    """``FluxPipeline``'s sampling sigmas before the shift: linspace(1, 1/N, N)."""
    return np.linspace(1.0, 1 / num_steps, num_steps)


class FluxFamily(FlowFamily):
    """FLUX.1 (``FluxPipeline``; module docstring): a ``FluxTransformer2DModel`` with CLIP (``CLIPTextModel``: its
    pooled output, ``pooled_prompt_embeds`` [B, P]) and T5 (``T5EncoderModel``: its last hidden state,
    ``prompt_embeds`` [B, max_sequence_length, D]; the tokenizer is only called); the transformer takes the latents
    packed 2x2 into tokens, timestep / 1000 and the guidance embedding, never CFG."""

    name, title, pipeline = "flux", "FLUX.1", "FluxPipeline"
    markers = ("flux",)
    text_parts = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")  # CLIP, T5
    transformer_class = "FluxTransformer2DModel"
    lora_target_modules = FLUX_LORA_TARGET_MODULES
    guidance_scale, max_sequence_length = 3.5, 512  # FluxPipeline's defaults
    layout = ("FluxPipeline (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, text_encoder_2/, "
              "tokenizer_2/, scheduler/)")

    def check_vae(self, vae) -> None:
        if getattr(vae.config, "shift_factor", None) is None:
            raise ValueError("FLUX.1 needs a VAE with shift_factor in its config (FLUX's AutoencoderKL has one)")

    def default_size(self, vae_scale_factor: int) -> int:
        """The stock pipeline's 128 latent pixels x the VAE factor (1024 with the FLUX VAE)."""
        return DEFAULT_SAMPLE_SIZE * vae_scale_factor

    def pixel_multiple(self, vae_scale_factor: int) -> int:
        return 2 * vae_scale_factor  # latents packed 2x2 into the transformer's tokens

    def latent_shape(self, batch: int, height: int, width: int, vae_scale_factor: int) -> tuple[int, int, int, int]:
        """(B, in_channels / 4, H, W): ``FluxPipeline.prepare_latents`` before packing."""
        scale = vae_scale_factor
        return (batch, self.config.in_channels // 4, 2 * (height // (scale * 2)), 2 * (width // (scale * 2)))

    def image_tokens(self, height: int, width: int, vae_scale_factor: int) -> int:
        """(H / 2) (W / 2): the packed image sequence length."""
        _, _, h, w = self.latent_shape(1, height, width, vae_scale_factor)
        return (h // 2) * (w // 2)

    def set_timesteps(self, scheduler, num_steps: int, image_tokens: int) -> None:
        """``FluxPipeline``: sigmas ``flux_sigmas(N)`` (None with ``use_flow_sigmas``) and the dynamic shift
        mu = ``calculate_shift(image_tokens)``."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = scheduler.config
        mu = calculate_shift(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        if config.get("use_flow_sigmas", False):
            scheduler.set_timesteps(num_steps, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=flux_sigmas(num_steps), mu=mu)

    def encode_prompts(self, prompts: list[str], device: torch.device, dtype: torch.dtype,
                       max_sequence_length: int) -> dict[str, Tensor]:
        """``FluxPipeline.encode_prompt`` (one image per prompt): ``prompt_embeds`` [B, max_sequence_length,
        D_T5] (T5's last hidden state) and ``pooled_prompt_embeds`` [B, D_CLIP] (CLIP's pooled output)."""
        prompts = list(prompts)
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids.to(device)
        pooled = self.text_encoder(ids, output_hidden_states=False).pooler_output
        ids_2 = self.tokenizer_2(prompts, padding="max_length", max_length=max_sequence_length,
                                 truncation=True, return_tensors="pt").input_ids.to(device)
        embeds = self.text_encoder_2(ids_2, output_hidden_states=False)[0]
        return {"prompt_embeds": embeds.to(dtype), "pooled_prompt_embeds": pooled.to(dtype)}

    def velocity(self, policy: FlowPolicyBase, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor],
                 cfg: bool) -> Tensor:
        """Velocity v [B, C, H, W] of ``model`` at unpacked ``latents`` and scheduler timesteps ``t_B`` [B]:
        one call on the packed tokens with timestep / 1000, zero ``txt_ids``, ``img_ids`` and the guidance
        embedding (``policy.guidance_scale``, whatever ``cfg`` says: FLUX has no CFG to turn off)."""
        b, _, h, w = latents.shape
        x = pack_latents(latents.to(policy.dtype))
        embeds = cond["prompt_embeds"]
        guidance = (torch.full((b,), float(policy.guidance_scale), device=x.device, dtype=torch.float32)
                    if self.config.guidance_embeds else None)
        out = model(hidden_states=x, timestep=t_B.to(x.device, x.dtype) / 1000, guidance=guidance,
                    pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=embeds,
                    txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=embeds.dtype),
                    img_ids=latent_image_ids(h, w, x.device, x.dtype), return_dict=False)[0]
        return unpack_latents(out, h, w)

    @staticmethod
    def load_text_parts(path_or_hub_id: str, opts: dict[str, Any], model_kw: dict[str, Any],
                        load_t5: bool) -> dict[str, Any]:
        """CLIP (``CLIPTextModel``, ``CLIPTokenizer``) and T5 (``T5EncoderModel``, ``AutoTokenizer``)."""
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel

        return {
            "text_encoder": CLIPTextModel.from_pretrained(path_or_hub_id, subfolder="text_encoder", **model_kw),
            "tokenizer": CLIPTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer", **opts),
            "text_encoder_2": T5EncoderModel.from_pretrained(path_or_hub_id, subfolder="text_encoder_2", **model_kw),
            "tokenizer_2": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_2", **opts),
        }


class FluxPolicy(FlowPolicyBase):
    """``FlowPolicyBase`` with ``family=FluxFamily`` (FLUX.1), kept as a name: its text parts CLIP and T5 (as
    ``text_encoder_2``), the guidance embedding (never CFG), its defaults and its saving are ``FluxFamily``'s."""

    family_class = FluxFamily
