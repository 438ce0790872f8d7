"""Wan 2.1 text-to-video (Wan team, 2025; diffusers' ``WanPipeline``) as a flow-matching family adapter:
``FlowPolicyBase(family=WanFamily)`` samples it with Flow-GRPO's SDE step (or trains it with the forward-process
kernel), scores it and saves it like every flow family -- a video is one more latent shape. What is Wan's, restated
from diffusers/pipelines/wan/pipeline_wan.py:

* one text encoder, UMT5 (``text_encoder``, a transformers ``UMT5EncoderModel``; ``tokenizer``): each prompt
  cleaned (``prompt_clean``), padded to ``max_sequence_length`` (512), its last hidden state kept for the prompt's
  real tokens and zero past them: ``prompt_embeds`` [B, L, D]. CFG's unconditional branch is the empty prompt
  (the stock default negative prompt) and the guidance ``u + w (c - u)`` with the stock w = 5.
* 5-D latents [B, z_dim, (F - 1) / 4 + 1, H / 8, W / 8] of an F-frame clip (F = 4k + 1: the VAE keeps the first
  frame and compresses every 4 after it); the transformer patches them 1 x 2 x 2 and takes the timestep sigma x 1000.
* the Wan VAE (``AutoencoderKLWan``): latents are normalised per channel, z = (x - latents_mean) / latents_std, so
  decoding is x = z latents_std + latents_mean, then [B, 3, F, H, W] pixels.
* sampling: the step kernel needs ``FlowMatchEulerDiscreteScheduler``; the hub folders ship a
  ``UniPCMultistepScheduler`` with ``flow_shift`` (3.0 for 480p), so the policy samples with FlowMatchEuler at
  ``shift = flow_shift``, as DanceGRPO (XueZeyue/DanceGRPO, ``--shift``) and Flow-Factory (``flow_shift``) do for
  Wan; stock ``WanPipeline`` takes that scheduler too, so a saved folder samples as the run did.

A sample's completion is a video: a list of F PIL frames (what ``unialign.rewards.video`` scores).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from unialign.image.denoiser import to_uint8_frames
from unialign.image.family import SamplerKnobs
from unialign.image.flow_policy import FlowFamily, FlowPolicyBase

Tensor = torch.Tensor

# the self- and cross-attention projections of every block (Flow-Factory's "default" Wan targets; diffusers' LoRA
# training scripts' attention set)
WAN_LORA_TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0"]
DEFAULT_FRAMES, DEFAULT_HEIGHT, DEFAULT_WIDTH = 81, 480, 832  # WanPipeline's defaults


class WanFamily(FlowFamily):
    """Wan 2.1 text-to-video (``WanPipeline``: a ``WanTransformer3DModel`` with a UMT5 text encoder and the Wan
    VAE; module docstring). Its one extra sampler knob is ``num_frames``."""

    name, title, pipeline = "wan", "Wan 2.1", "WanPipeline"
    markers = ("wan2.1", "wan-ai/")
    knobs = (*FlowFamily.knobs, "num_frames")
    text_parts = ("text_encoder", "tokenizer")
    transformer_class = "WanTransformer3DModel"
    text_keys = cond_keys = ("prompt_embeds",)
    lora_target_modules = WAN_LORA_TARGET_MODULES
    guidance_scale, max_sequence_length = 5.0, 512  # WanPipeline's defaults (its g is w here: u + g (c - u))
    vae_class = "AutoencoderKLWan"
    output_kind = ("video", "frames")
    layout = "WanPipeline (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/)"
    num_frames: int = DEFAULT_FRAMES  # the clip length the policy samples (``defaults`` sets it)

    def __init__(self, transformer, **parts: Any) -> None:
        super().__init__(transformer, **parts)
        self.patch = tuple(self.config.patch_size)  # (frames, height, width) per token
        self._temporal = 4  # frames per latent frame after the first: the VAE's (``check_vae``)

    def check_vae(self, vae) -> None:
        for key in ("latents_mean", "latents_std", "scale_factor_temporal", "scale_factor_spatial"):
            if getattr(vae.config, key, None) is None:
                raise ValueError(f"Wan needs its AutoencoderKLWan (a VAE with {key} in its config)")
        self._temporal = int(vae.config.scale_factor_temporal)

    @staticmethod
    def vae_scale_factor(vae) -> int:
        return int(vae.config.scale_factor_spatial)

    @staticmethod
    def flow_scheduler(scheduler):
        """A ``FlowMatchEulerDiscreteScheduler`` as given; a Wan folder's ``UniPCMultistepScheduler`` (or its config)
        as FlowMatchEuler with ``shift = flow_shift`` and its training timesteps (module docstring)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            return scheduler
        if hasattr(scheduler, "config"):
            config, kind = dict(scheduler.config), type(scheduler).__name__
        else:
            config, kind = dict(scheduler), scheduler.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        if kind == FlowMatchEulerDiscreteScheduler.__name__ or "flow_shift" not in config:
            return FlowMatchEulerDiscreteScheduler.from_config(config)
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000),
                                               shift=float(config.get("flow_shift") or 1.0))

    def defaults(self, knobs: SamplerKnobs, vae_scale_factor: int) -> SamplerKnobs:
        """WanPipeline's defaults where unset (480 x 832, 81 frames, w 5, 512 tokens); ValueError naming
        ``num_frames`` unless it is 4k + 1 (the stock pipeline rounds it with a warning; a trajectory is what
        was asked for)."""
        knobs = replace(knobs, height=knobs.height or DEFAULT_HEIGHT, width=knobs.width or DEFAULT_WIDTH,
                        num_frames=knobs.num_frames or DEFAULT_FRAMES)
        step = self._temporal
        if knobs.num_frames < 1 or (knobs.num_frames - 1) % step:
            raise ValueError(f"num_frames must be {step}k + 1 for {self.title} (the VAE keeps the first frame and "
                             f"compresses every {step} after it), got {knobs.num_frames}")
        self.num_frames = knobs.num_frames
        return super().defaults(knobs, vae_scale_factor)

    def default_size(self, vae_scale_factor: int) -> int:
        return DEFAULT_HEIGHT  # (``defaults`` sets the width apart: WanPipeline's 480 x 832)

    def pixel_multiple(self, vae_scale_factor: int) -> int:
        return vae_scale_factor * self.patch[1]

    def latent_shape(self, batch: int, height: int, width: int, vae_scale_factor: int) -> tuple[int, ...]:
        """(B, in_channels, (F - 1) / 4 + 1, H / 8, W / 8): ``WanPipeline.prepare_latents``."""
        frames = (self.num_frames - 1) // self._temporal + 1
        return (batch, self.config.in_channels, frames, height // vae_scale_factor, width // vae_scale_factor)

    def image_tokens(self, height: int, width: int, vae_scale_factor: int) -> int:
        _, _, f, h, w = self.latent_shape(1, height, width, vae_scale_factor)
        return (f // self.patch[0]) * (h // self.patch[1]) * (w // self.patch[2])

    def set_timesteps(self, scheduler, num_steps: int, image_tokens: int) -> None:
        """``set_timesteps(N)``, as ``WanPipeline`` (no dynamic shift: the shift is the scheduler's)."""
        scheduler.set_timesteps(num_steps)

    def encode_prompts(self, prompts: list[str], device: torch.device, dtype: torch.dtype,
                       max_sequence_length: int) -> dict[str, Tensor]:
        """``WanPipeline._get_t5_prompt_embeds``: ``prompt_embeds`` [B, max_sequence_length, D], UMT5's last
        hidden state on each cleaned prompt's tokens, zero past them."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device)
        hidden = self.text_encoder(ids, mask).last_hidden_state
        return {"prompt_embeds": (hidden * mask[..., None].to(hidden.dtype)).to(dtype)}

    def velocity(self, policy: FlowPolicyBase, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor],
                 cfg: bool) -> Tensor:
        """v [B, C, F, H, W] at (latents, t); with CFG (``cfg`` and guidance_scale > 1) one doubled batch
        [uncond; cond] and u + w (c - u) (``policy._guided``; the stock pipeline calls the two branches apart)."""
        x = latents.to(policy.dtype)

        def call(hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor) -> Tensor:
            return model(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                         return_dict=False)[0]

        embeds = cond["prompt_embeds"]
        if not (cfg and policy._cfg):
            return call(x, t_B, embeds)
        b, uncond = x.shape[0], policy._uncond()
        doubled = dict(hidden_states=torch.cat([x, x]), timestep=torch.cat([t_B, t_B]),
                       encoder_hidden_states=torch.cat([uncond["prompt_embeds"].expand(b, -1, -1), embeds]))
        return policy._guided(call, doubled, b)

    def _latent_stats(self, vae, z: Tensor) -> tuple[Tensor, Tensor]:
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=z.device).view(shape)
        std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=z.device).view(shape)
        return mean, std

    @torch.no_grad()
    def decode(self, vae, latents: Tensor) -> list[list]:
        """B videos, each a list of F PIL frames: x = z latents_std + latents_mean through the VAE (fp32), as
        ``WanPipeline`` (its ``latents / (1 / std) + mean``)."""
        z = latents.float()
        mean, std = self._latent_stats(vae, z)
        pixels = vae.decode(z * std + mean).sample  # [B, 3, F, H, W]
        return [to_uint8_frames(video.transpose(0, 1)) for video in pixels]

    def encode(self, vae, pixels: Tensor, sample_posterior: bool, generator: torch.Generator | None) -> Tensor:
        raise ValueError("Diffusion-DPO pairs are images; Wan's completions are videos (preference pairs of videos "
                         "are not built: train Wan with GRPO or the forward-process algorithms)")

    def sampling_extras(self) -> dict[str, Any]:
        return {"num_frames": int(self.num_frames)}

    @staticmethod
    def load_text_parts(path_or_hub_id: str, opts: dict[str, Any], model_kw: dict[str, Any],
                        load_t5: bool) -> dict[str, Any]:
        """UMT5 (``UMT5EncoderModel``) and its tokenizer; a UserError for a Wan 2.2 folder (two experts switched at a
        boundary timestep, or TI2V's per-token timesteps: not what this adapter samples)."""
        from diffusers import DiffusionPipeline
        from transformers import AutoTokenizer, UMT5EncoderModel

        from unialign.errors import UserError

        index = DiffusionPipeline.load_config(path_or_hub_id, **opts)
        if (index.get("transformer_2") or [None])[0] is not None or index.get("boundary_ratio") is not None \
                or index.get("expand_timesteps"):
            raise UserError(f"{path_or_hub_id!r} is a Wan 2.2 pipeline (a second transformer / boundary_ratio / "
                             "expand_timesteps); the wan family samples Wan 2.1's single transformer")

        return {"text_encoder": UMT5EncoderModel.from_pretrained(path_or_hub_id, subfolder="text_encoder", **model_kw),
                "tokenizer": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer", **opts)}
