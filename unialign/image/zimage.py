"""Z-Image (Tongyi-MAI, 2025; diffusers' ``ZImagePipeline``) as a family adapter: ``FlowPolicyBase(family=
ZImageFamily)`` samples it with Flow-GRPO's SDE step, scores it, trains it (GRPO, AWM / DiffusionNFT,
Diffusion-DPO) and saves it like every flow family. What is Z-Image's, restated from
diffusers/pipelines/z_image/pipeline_z_image.py:

* one text encoder, Qwen3 (``text_encoder``, a transformers ``Qwen3Model``; ``tokenizer`` with its chat template):
  each prompt wrapped as one user message (``add_generation_prompt``, ``enable_thinking``), padded to
  ``max_sequence_length``, the encoder's second-to-last hidden state; the transformer reads each prompt's real
  tokens only, so the payload keeps the padded states ``prompt_embeds`` [B, L, D] with ``prompt_mask`` [B, L].
* the transformer takes lists (one [C, 1, H, W] latent and one [L_i, D] caption per image) and the time
  1 - sigma, and predicts -v: the velocity is its output negated.
* CFG is ``c + g (c - u)`` there; here, as for every family, ``u + w (c - u)``: the same with w = g + 1, so the
  stock default g = 5 is ``guidance_scale`` 6 (w <= 1: no CFG, e.g. Z-Image-Turbo's g = 0).
* sigmas ``linspace(1, 1/N, N)`` shifted by ``mu = calculate_shift(image tokens)``; latents packed 2x2 by the
  transformer itself (sides multiples of 2 x the VAE factor); the FLUX VAE (``shift_factor``).
"""

from __future__ import annotations

from typing import Any

import torch

from unialign.image.flow_policy import FlowFamily, FlowPolicyBase

Tensor = torch.Tensor

# the attention projections (diffusers' LoRA training scripts' default target_modules)
ZIMAGE_LORA_TARGET_MODULES = ["to_k", "to_q", "to_v", "to_out.0"]


class ZImageFamily(FlowFamily):
    """Z-Image (``ZImagePipeline``, a ``ZImageTransformer2DModel`` with a Qwen3 text encoder; module docstring)."""

    name, title, pipeline = "zimage", "Z-Image", "ZImagePipeline"
    markers = ("z-image", "zimage")
    text_parts = ("text_encoder", "tokenizer")
    transformer_class = "ZImageTransformer2DModel"
    text_keys = cond_keys = ("prompt_embeds", "prompt_mask")
    lora_target_modules = ZIMAGE_LORA_TARGET_MODULES
    guidance_scale, max_sequence_length = 6.0, 512  # ZImagePipeline's defaults (its g = 5 is w = 6 here)
    layout = "ZImagePipeline (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/)"

    def __init__(self, transformer, **parts: Any) -> None:
        super().__init__(transformer, **parts)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("Z-Image's tokenizer needs a chat template (its prompts are chat messages, as "
                             "ZImagePipeline's); this tokenizer has none")

    def check_vae(self, vae) -> None:
        if getattr(vae.config, "shift_factor", None) is None:
            raise ValueError("Z-Image needs a VAE with shift_factor in its config (the FLUX AutoencoderKL has one)")

    def default_size(self, vae_scale_factor: int) -> int:
        return 1024  # ZImagePipeline's height / width when unset

    def pixel_multiple(self, vae_scale_factor: int) -> int:
        return 2 * vae_scale_factor  # the transformer's 2x2 patches

    def latent_shape(self, batch: int, height: int, width: int, vae_scale_factor: int) -> tuple[int, int, int, int]:
        """(B, in_channels, H, W): ``ZImagePipeline.prepare_latents``."""
        scale = 2 * vae_scale_factor
        return (batch, self.config.in_channels, 2 * (height // scale), 2 * (width // scale))

    def image_tokens(self, height: int, width: int, vae_scale_factor: int) -> int:
        _, _, h, w = self.latent_shape(1, height, width, vae_scale_factor)
        return (h // 2) * (w // 2)

    def set_timesteps(self, scheduler, num_steps: int, image_tokens: int) -> None:
        """``ZImagePipeline``: sigmas ``linspace(1, 1/N, N)`` (float32, as there) and mu = ``calculate_shift``."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

        config = scheduler.config
        mu = calculate_shift(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), mu=mu)

    def encode_prompts(self, prompts: list[str], device: torch.device, dtype: torch.dtype,
                       max_sequence_length: int) -> dict[str, Tensor]:
        """``ZImagePipeline._encode_prompt``: ``prompt_embeds`` [B, max_sequence_length, D] (the second-to-last
        hidden state, zero past each prompt's tokens) and ``prompt_mask`` [B, max_sequence_length] (bool)."""
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=True)
                 for p in prompts]
        inputs = self.tokenizer(texts, padding="max_length", max_length=max_sequence_length, truncation=True,
                                return_tensors="pt")
        ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device).bool()
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
        return {"prompt_embeds": (hidden * mask[..., None]).to(dtype), "prompt_mask": mask}

    def velocity(self, policy: FlowPolicyBase, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor],
                 cfg: bool) -> Tensor:
        """v [B, C, H, W] = minus the transformer's output at (latents, time 1 - t / 1000) on each prompt's real
        tokens; with CFG (``cfg`` and guidance_scale > 1) one doubled call [uncond; cond] and u + w (c - u)."""
        embeds, mask = cond["prompt_embeds"], cond["prompt_mask"].bool()
        x = latents.to(policy.dtype)

        def call(x: Tensor, t: Tensor, embeds: Tensor, mask: Tensor) -> Tensor:
            captions = [e[m] for e, m in zip(embeds, mask)]
            out = model(list(x.unsqueeze(2).unbind(0)), (1000 - t.to(x.dtype)) / 1000, captions, return_dict=False)[0]
            return -torch.stack(out).squeeze(2)

        if not (cfg and policy._cfg):
            return call(x, t_B, embeds, mask)
        b, uncond = x.shape[0], policy._uncond()
        doubled = dict(x=torch.cat([x, x]), t=torch.cat([t_B, t_B]),
                       embeds=torch.cat([uncond["prompt_embeds"].expand(b, -1, -1), embeds]),
                       mask=torch.cat([uncond["prompt_mask"].bool().expand(b, -1), mask]))
        return policy._guided(call, doubled, b)

    @staticmethod
    def load_text_parts(path_or_hub_id: str, opts: dict[str, Any], model_kw: dict[str, Any],
                        load_t5: bool) -> dict[str, Any]:
        """The Qwen3 encoder (``AutoModel``: the folder's ``Qwen3Model``, no remote code) and its tokenizer."""
        from transformers import AutoModel, AutoTokenizer

        return {"text_encoder": AutoModel.from_pretrained(path_or_hub_id, subfolder="text_encoder", **model_kw),
                "tokenizer": AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer", **opts)}
