"""``DiffusionPolicy``: Stable Diffusion 1.x / SDXL behind the modality-neutral ``Policy`` protocol.

The policy is the DDIM step on the shared denoiser part (``unialign.image.denoiser.DenoiserPolicy``:
trajectory recording, per-step log-probs over the trained steps, the reference, LoRA, saving, preference
batches) and one small family adapter chosen at construction: ``SD1Family`` (one CLIP encoder, the UNet
conditions on ``prompt_embeds`` only) or ``SDXLFamily`` (two CLIP encoders, plus ``added_cond_kwargs`` with the
pooled embedding and the size micro-conditioning ``time_ids``). The adapter encodes prompts, builds the UNet's
extra conditioning, names the payload's condition keys and the diffusers pipeline class; the shared code
never asks which family it runs.

A trajectory is the N denoising transitions x_T -> ... -> x_0 of a DDIM sampler with eta > 0 (DDPO,
Black et al. 2023); ``logp_B_T`` is each transition's Gaussian log-density averaged over C,H,W
(``unialign.image.ddim``). For preference pairs ``sequence_log_prob`` returns the Diffusion-DPO ELBO
surrogate (Wallace et al. 2023). The UNet (``self.model``) is the only trainable module; VAE and text
encoders are frozen. Attention uses PyTorch SDPA (diffusers' default ``AttnProcessor2_0``) unless
``enable_xformers=True``.

Payload written by ``sample`` (read only by this class), every tensor with leading B:
    latents        [B, N+1, C, H, W]  x_T .. x_0 in the UNet dtype
    timesteps      [B, N]             long, the t of each transition x_t -> x_{t'}
    prompt_embeds  [B, L, D]          text conditioning (SDXL: both encoders' penultimate states)
    pooled_prompt_embeds [B, P]       SDXL only: pooled output of the 2nd encoder (``text_embeds``)
    time_ids       [B, 6]             SDXL only: original (h, w), crop top-left (top, left), target (h, w)
"""

from __future__ import annotations

from typing import Any

import torch

from unialign.image.denoiser import DenoiserPolicy
from unialign.image.family import ImageFamily, SamplerKnobs
from unialign.image.kernels import DDIMKernel
from unialign.types import PreferenceBatch

Tensor = torch.Tensor

LORA_TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0"]


def tokenize(tokenizer, prompts: list[str], device: torch.device) -> Tensor:
    """Token ids [B, L] of ``prompts``, padded / truncated to the tokenizer's ``model_max_length``, on ``device``."""
    return tokenizer(list(prompts), padding="max_length", max_length=tokenizer.model_max_length,
                     truncation=True, return_tensors="pt").input_ids.to(device)


def time_ids_from_rows(rows: list[list[int]], dtype: torch.dtype, device: torch.device) -> Tensor:
    """SDXL micro-conditioning [B, 6] from one row (orig_h, orig_w, crop_top, crop_left, target_h, target_w)
    per image (Podell et al. 2023, sec. 2.2; diffusers ``StableDiffusionXLPipeline._get_add_time_ids``)."""
    return torch.tensor(rows, dtype=dtype, device=device)


class UNetFamily(ImageFamily):
    """What ``DiffusionPolicy``'s shared DDIM code asks of a pipeline family (``SD1Family``, ``SDXLFamily``):
    the frozen text encoders and how to encode prompts, the per-image size micro-conditioning, the UNet's
    ``added_cond_kwargs`` and the payload's condition keys (the family's row: ``ImageFamily``'s class attributes).

    Class attributes (beyond ``ImageFamily``'s):
        text_keys: what ``encode_prompts`` returns (``prompt_embeds`` [B, L, D], ...).
        micro_keys: what ``micro_cond`` returns (per-image size conditioning).
        cond_keys: ``text_keys + micro_keys``, the conditioning a trajectory payload carries.
    """

    policy = "unialign.image.policy:DiffusionPolicy"
    kernel = "ddim"
    knobs = DDIMKernel.knobs
    replacement_vae = True
    text_parts = ("text_encoder", "tokenizer")
    text_keys: tuple[str, ...] = ()
    micro_keys: tuple[str, ...] = ()
    cond_keys: tuple[str, ...] = ()

    def encode_prompts(self, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
        """``text_keys`` tensors for ``prompts``, each with leading B, in ``dtype`` on ``device``."""
        raise NotImplementedError

    def micro_cond(self, rows_B_6: list[list[int]], dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
        """``micro_keys`` tensors from one row (orig_h, orig_w, crop_top, crop_left, target_h, target_w) per image."""
        raise NotImplementedError

    def added_cond_kwargs(self, cond: dict[str, Tensor], uncond: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        """The UNet's ``added_cond_kwargs`` for the R rows of ``cond`` (``cond_keys``); with ``uncond`` (CFG: the
        empty prompt's ``text_keys``, batch 1) for the 2R rows [uncond x R; cond]."""
        raise NotImplementedError

    @staticmethod
    def describes(unet, parts: dict[str, Any]) -> bool:
        """Whether a UNet and the text parts given with it are this family's (``choose_family``)."""
        raise NotImplementedError

    @classmethod
    def load(cls, path_or_hub_id: str, guessed: bool = False, **kwargs: Any):
        """``ImageFamily.load``; a guessed family is left to the folder's ``model_index.json`` (SD1.x or SDXL: a
        hub id's name may not say)."""
        if guessed:
            return cls.policy_class().from_pretrained(path_or_hub_id, **kwargs)
        return super().load(path_or_hub_id, **kwargs)

    @staticmethod
    def load_text_parts(path_or_hub_id: str, opts: dict[str, Any], model_kw: dict[str, Any]) -> dict[str, Any]:
        """Text components a pipeline folder holds beyond ``text_encoder`` / ``tokenizer`` (``from_pretrained``)."""
        return {}

    @staticmethod
    def load_defaults(config: dict[str, Any]) -> dict[str, Any]:
        """Constructor defaults read from the folder's ``model_index.json`` (``from_pretrained``)."""
        return {}


class SD1Family(UNetFamily):
    """Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``): one CLIP text encoder; the UNet takes
    ``encoder_hidden_states`` = ``prompt_embeds`` [B, L, D] and no ``added_cond_kwargs``."""

    name, title, pipeline = "sd", "SD1.x", "StableDiffusionPipeline"
    text_keys = ("prompt_embeds",)
    micro_keys = ()
    cond_keys = text_keys + micro_keys

    @staticmethod
    def describes(unet, parts: dict[str, Any]) -> bool:
        """Any UNet without SDXL's ``addition_embed_type="text_time"``, given one text encoder."""
        return parts.get("text_encoder_2") is None and unet.config.get("addition_embed_type") != "text_time"

    def encode_prompts(self, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
        """``prompt_embeds`` [B, L, D]: the encoder's last hidden state."""
        out = self.text_encoder(tokenize(self.tokenizer, prompts, device))
        return {"prompt_embeds": out[0].to(dtype)}

    def micro_cond(self, rows_B_6: list[list[int]], dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
        """SD1.x has no size micro-conditioning."""
        return {}

    def added_cond_kwargs(self, cond: dict[str, Tensor], uncond: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        """None: the SD1.x UNet takes no added conditioning."""
        return None


class SDXLFamily(UNetFamily):
    """SDXL (``StableDiffusionXLPipeline``; Podell et al. 2023): two CLIP text encoders, the 2nd with a
    projection. ``prompt_embeds`` [B, L, D1 + D2] is both encoders' penultimate hidden states side by side;
    the UNet also takes ``added_cond_kwargs`` = {"text_embeds": ``pooled_prompt_embeds`` [B, P] (the 2nd
    encoder's projected pooled output), "time_ids": [B, 6] (original size, crop top-left, target size)}."""

    name, title, pipeline = "sdxl", "SDXL", "StableDiffusionXLPipeline"
    markers = ("xl",)
    text_parts = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    text_keys = ("prompt_embeds", "pooled_prompt_embeds")
    micro_keys = ("time_ids",)
    cond_keys = text_keys + micro_keys

    def __init__(self, **parts: Any) -> None:
        if parts.get("text_encoder_2") is None:
            raise ValueError("an SDXL UNet (addition_embed_type='text_time') needs text_encoder_2 and tokenizer_2")
        super().__init__(**parts)

    @staticmethod
    def describes(unet, parts: dict[str, Any]) -> bool:
        """A second text encoder given, or a UNet with SDXL's ``addition_embed_type="text_time"``."""
        return parts.get("text_encoder_2") is not None or unet.config.get("addition_embed_type") == "text_time"

    @staticmethod
    def describes_folder(config: dict[str, Any]) -> bool:
        """Whether a pipeline folder's ``model_index.json`` is an SDXL one."""
        return "XL" in config.get("_class_name", "") or "text_encoder_2" in config

    def encode_prompts(self, prompts: list[str], device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
        """``prompt_embeds`` [B, L, D1 + D2] (penultimate hidden states of both encoders) and
        ``pooled_prompt_embeds`` [B, P] (the 2nd encoder's projected pooled output)."""
        hidden, pooled = [], None
        for tok, enc in ((self.tokenizer, self.text_encoder), (self.tokenizer_2, self.text_encoder_2)):
            out = enc(tokenize(tok, prompts, device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled = out.text_embeds if getattr(out, "text_embeds", None) is not None else out.pooler_output
        return {"prompt_embeds": torch.cat(hidden, dim=-1).to(dtype), "pooled_prompt_embeds": pooled.to(dtype)}

    def micro_cond(self, rows_B_6: list[list[int]], dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
        """{"time_ids": [B, 6]}."""
        return {"time_ids": time_ids_from_rows(rows_B_6, dtype, device)}

    def added_cond_kwargs(self, cond: dict[str, Tensor], uncond: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        """{"text_embeds": [R or 2R, P], "time_ids": [R or 2R, 6]}; under CFG both halves share the time_ids,
        as the stock pipeline."""
        text, time_ids = cond["pooled_prompt_embeds"], cond["time_ids"]
        if uncond is not None:
            text = torch.cat([uncond["pooled_prompt_embeds"].expand(text.shape[0], -1), text])
            time_ids = torch.cat([time_ids, time_ids])
        return {"text_embeds": text, "time_ids": time_ids}

    @staticmethod
    def load_text_parts(path_or_hub_id: str, opts: dict[str, Any], model_kw: dict[str, Any]) -> dict[str, Any]:
        """``text_encoder_2`` (``CLIPTextModelWithProjection``) and ``tokenizer_2``."""
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        encoder = CLIPTextModelWithProjection.from_pretrained(path_or_hub_id, subfolder="text_encoder_2", **model_kw)
        return {"text_encoder_2": encoder,
                "tokenizer_2": CLIPTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_2", **opts)}

    @staticmethod
    def load_defaults(config: dict[str, Any]) -> dict[str, Any]:
        """``force_zeros_for_empty_prompt`` as the folder says (stock SDXL: True)."""
        return {"force_zeros_for_empty_prompt": config.get("force_zeros_for_empty_prompt", False)}


def choose_family(unet, family: type[UNetFamily] | None = None, **parts: Any) -> UNetFamily:
    """The adapter of ``family``, else of the first family (``UNET_FAMILIES``, most specific first) that
    ``describes`` the UNet and its parts: ``SDXLFamily`` when a second text encoder is given or the UNet has SDXL's
    ``addition_embed_type="text_time"`` (which then needs ``text_encoder_2``), else ``SD1Family``; holding
    ``parts``."""
    chosen = family or next(f for f in UNET_FAMILIES if f.describes(unet, parts))
    return chosen(**parts)


UNET_FAMILIES = (SDXLFamily, SD1Family)  # the order choose_family asks them in


class DiffusionPolicy(DenoiserPolicy):
    """SD1.x / SDXL policy with a DDIM sampler that records per-step log-probs (the family adapter on
    ``DenoiserPolicy``, with ``unialign.image.kernels.DDIMKernel`` as its step kernel).

    Args:
        unet, vae, text_encoder, tokenizer, scheduler: diffusers / transformers components. Any scheduler
            is converted to a ``DDIMScheduler`` with the same config.
        text_encoder_2, tokenizer_2: the second (``CLIPTextModelWithProjection``) encoder of SDXL. The
            policy is SDXL when given (or when the UNet has ``addition_embed_type="text_time"``).
            The family adapter (``self.family``: ``SD1Family`` or ``SDXLFamily``) is chosen here, once.
        num_steps: N denoising steps.  guidance_scale: CFG weight w (> 1 turns CFG on; the
            unconditional branch uses the empty prompt's embeddings, or zeros when
            ``force_zeros_for_empty_prompt``, as stock SDXL does).  eta: DDIM eta (> 0).
        height, width: image size in pixels (default: UNet sample_size x VAE scale factor).
        timestep_fraction: fraction of the trainable steps trained per sample (K = max(1, int(fraction x
            trainable))), chosen per sample at random.
        min_step_std: steps whose noise std sigma_t is below this are never trained (default 0: every
            step is trainable). A policy-gradient term scales as 1/sigma_t while a nearly deterministic
            last step hardly changes the image, so the last steps carry a large gradient and almost no
            reward signal (measured in docs/images.md; Flow-GRPO skips its last step for the same reason).
        lora_rank: > 0 adds a peft LoRA (r = rank, alpha = ``lora_alpha`` or rank) on the UNet
            attention projections and freezes the base UNet; 0 trains the full UNet.
        gradient_checkpointing: UNet gradient checkpointing.  enable_xformers: xformers attention
            (raises if xformers is not installed).
        seed: seeds the policy's own generator, used by ``sequence_log_prob`` when a batch does not
            carry its timesteps/noise, and by ``preference_batch``.
        caption_dropout: probability of training a preference pair on the empty caption (Diffusion-DPO
            uses 0.2), so classifier-free guidance keeps working.
        cfg_uncond_grad: with CFG in training, the gradient also flows through the unconditional branch
            (default: DDPO as published); False computes it under no_grad (Flow-GRPO's layout: a third less
            training compute, half the UNet activations, a different gradient).
        train_chunk_size: (sample, step) pairs per forward / backward in training (``step_chunks``): the
            trainer splits a micro-batch's trained steps into chunks of this many with one backward each
            and the loss normaliser of the whole optimizer step, so the update is the same while only one
            chunk's activations are alive (ddpo-pytorch / TRL train one step of the batch at a time).
            0: all trained steps of a micro-batch in one UNet call.
        sample_batch_size: ``sample`` denoises the prompts this many at a time (TRL's ``sample_batch_size``):
            the sampling activations of one chunk are alive, not the whole batch's. 0: all at once. The
            chunks draw their noise one after the other from the same generator.
        knobs: the sampler knobs as one frozen value (``unialign.image.families.SamplerKnobs``); its set fields
            replace the keywords of the same name (``self.knobs``: the values used, unset height / width None).
        family: the adapter class (``SD1Family`` or ``SDXLFamily``); None: chosen from the UNet and the text parts.
    """

    denoiser_subfolder = "unet"

    def __init__(
        self,
        unet,
        vae,
        text_encoder,
        tokenizer,
        scheduler,
        text_encoder_2=None,
        tokenizer_2=None,
        *,
        num_steps: int = 50,
        guidance_scale: float = 5.0,
        eta: float = 1.0,
        height: int | None = None,
        width: int | None = None,
        timestep_fraction: float = 1.0,
        min_step_std: float = 0.0,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
        gradient_checkpointing: bool = False,
        enable_xformers: bool = False,
        force_zeros_for_empty_prompt: bool = False,
        seed: int = 0,
        caption_dropout: float = 0.0,
        train_chunk_size: int = 0,
        sample_batch_size: int = 0,
        cfg_uncond_grad: bool = True,
        knobs: SamplerKnobs | None = None,
        family: type[UNetFamily] | None = None,
    ) -> None:
        from diffusers import DDIMScheduler

        k = self.knobs = SamplerKnobs.over(knobs, num_steps=num_steps, guidance_scale=guidance_scale, eta=eta,
                                           height=height, width=width, timestep_fraction=timestep_fraction,
                                           min_step_std=min_step_std)
        num_steps, guidance_scale, eta = k.num_steps, k.guidance_scale, k.eta
        if eta <= 0:
            raise ValueError(f"eta must be > 0 (the step log-probability needs sigma_t > 0), got {eta}")
        if not 0.0 < k.timestep_fraction <= 1.0:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {k.timestep_fraction}")
        self.unet = unet
        self.cfg_uncond_grad = cfg_uncond_grad
        # decode / encode in fp32 (half-precision SD VAEs overflow to NaN)
        self.vae = vae if vae.dtype == torch.float32 else vae.to(torch.float32)
        self.family = choose_family(unet, family, text_encoder=text_encoder, tokenizer=tokenizer,
                                    text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)
        self.scheduler = DDIMScheduler.from_config(scheduler.config)
        self.num_steps, self.guidance_scale = num_steps, guidance_scale
        self.scheduler.set_timesteps(num_steps)
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.height = k.height or unet.config.sample_size * self.vae_scale_factor
        self.width = k.width or unet.config.sample_size * self.vae_scale_factor
        self.kernel = DDIMKernel(self.scheduler, num_steps, eta, k.timestep_fraction, k.min_step_std)
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        self.generator = torch.Generator().manual_seed(seed)
        self.caption_dropout = caption_dropout
        self._setup_denoiser(unet, (self.vae, *self.family.text_encoders), lora_rank=lora_rank,
                             lora_alpha=lora_alpha, target_modules=LORA_TARGET_MODULES,
                             gradient_checkpointing=gradient_checkpointing, sample_batch_size=sample_batch_size,
                             train_chunk_size=train_chunk_size)
        if enable_xformers:
            try:
                import xformers  # noqa: F401
            except ImportError as e:
                raise RuntimeError("enable_xformers=True but xformers is not installed "
                                   "(pip install xformers, or leave it off: PyTorch SDPA is the default)") from e
            unet.enable_xformers_memory_efficient_attention()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str,
        sdxl: bool | None = None,
        lora_rank: int = 0,
        torch_dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        variant: str | None = None,
        vae_name_or_path: str | None = None,
        family: type[UNetFamily] | None = None,
        **kwargs: Any,
    ) -> DiffusionPolicy:
        """Load the components of a diffusers SD1.x / SDXL pipeline folder or hub id.

        ``family`` (``SD1Family`` / ``SDXLFamily``, or ``sdxl`` True / False) names the family; None detects it
        from ``model_index.json``. ``vae_name_or_path`` swaps in another VAE
        (e.g. ``madebyollin/sdxl-vae-fp16-fix``). ``torch_dtype`` may be a name ("float16").
        ``kwargs`` go to the constructor.
        Fails at once with a RuntimeError when the weights are neither local nor downloadable
        (offline with ``HF_HUB_OFFLINE=1``, unknown id, no network).
        """

        def build(opts: dict, model_kw: dict) -> dict[str, Any]:
            from diffusers import AutoencoderKL, DDIMScheduler, DiffusionPipeline, UNet2DConditionModel
            from transformers import CLIPTextModel, CLIPTokenizer

            config = DiffusionPipeline.load_config(path_or_hub_id, **opts)
            nonlocal family
            if family is None:
                family = SDXLFamily if (SDXLFamily.describes_folder(config) if sdxl is None else sdxl) else SD1Family
            parts = {
                "unet": UNet2DConditionModel.from_pretrained(path_or_hub_id, subfolder="unet", **model_kw),
                "vae": (AutoencoderKL.from_pretrained(vae_name_or_path, **opts) if vae_name_or_path
                        else AutoencoderKL.from_pretrained(path_or_hub_id, subfolder="vae", **opts)),
                "text_encoder": CLIPTextModel.from_pretrained(path_or_hub_id, subfolder="text_encoder", **model_kw),
                "tokenizer": CLIPTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer", **opts),
                "scheduler": DDIMScheduler.from_pretrained(path_or_hub_id, subfolder="scheduler", **opts),
            }
            parts.update(family.load_text_parts(path_or_hub_id, opts, model_kw))
            for key, value in family.load_defaults(config).items():
                kwargs.setdefault(key, value)
            return parts

        layout = ("pipeline (model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/[, "
                  "text_encoder_2/, tokenizer_2/])")
        parts = cls._load_parts(path_or_hub_id, build, "diffusion", layout, torch_dtype, variant, device,
                                also_required=(vae_name_or_path,) if vae_name_or_path else (),
                                sources={"vae": vae_name_or_path} if vae_name_or_path else None)
        return cls(**parts, lora_rank=lora_rank, family=family, **kwargs)

    # ------------------------------------------------------------------ family
    @property
    def is_sdxl(self) -> bool:
        """Whether the family adapter is ``SDXLFamily`` (read-only, for callers; the shared code never branches on
        it)."""
        return isinstance(self.family, SDXLFamily)

    def _tokenize(self, tokenizer, prompts: list[str]) -> Tensor:
        return tokenize(tokenizer, prompts, self.device)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, Tensor]:
        """Text conditioning for ``prompts`` (no grad), the family's ``encode_prompts``. SD1.x:
        ``prompt_embeds`` = last hidden state [B, L, D]. SDXL (as the stock pipeline): ``prompt_embeds`` =
        concatenated penultimate hidden states of both encoders [B, L, D1 + D2] and ``pooled_prompt_embeds`` =
        the 2nd encoder's projected pooled output [B, P]."""
        return self.family.encode_prompts(prompts, self.device, self.dtype)

    def _size_rows(self, batch: int, original_size=None, crop_top_left=(0, 0), target_size=None) -> list[list[int]]:
        """``batch`` equal rows (orig_h, orig_w, crop_top, crop_left, target_h, target_w); target defaults to
        the policy's (height, width), original to the target."""
        target = tuple(target_size or (self.height, self.width))
        return [list(original_size or target) + list(crop_top_left) + list(target)] * batch

    def time_ids(self, batch: int, original_size=None, crop_top_left=(0, 0), target_size=None) -> Tensor:
        """SDXL micro-conditioning [B, 6]: (orig_h, orig_w, crop_top, crop_left, target_h, target_w)."""
        return time_ids_from_rows(self._size_rows(batch, original_size, crop_top_left, target_size),
                                  self.dtype, self.device)

    def _denoise(self, unet, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor], cfg: bool) -> Tensor:
        """UNet output at (latents, t) under ``cond``; with ``cfg`` the guided u + w (c - u)."""
        embeds = cond["prompt_embeds"]
        uncond = self._uncond() if cfg else None
        added = self.family.added_cond_kwargs(cond, uncond)

        def call(sample: Tensor, timestep: Tensor, encoder_hidden_states: Tensor, added_cond_kwargs: Any) -> Tensor:
            return unet(sample.to(self.dtype), timestep, encoder_hidden_states=encoder_hidden_states,
                        added_cond_kwargs=added_cond_kwargs).sample

        if uncond is None:
            return call(latents, t_B, embeds, added)
        b = latents.shape[0]
        doubled = dict(sample=torch.cat([latents, latents]), timestep=torch.cat([t_B, t_B]),
                       encoder_hidden_states=torch.cat([uncond["prompt_embeds"].expand(b, -1, -1), embeds]),
                       added_cond_kwargs=added)
        return self._guided(call, doubled, b)

    def _pipeline_class(self):
        return self.family.pipeline_class()

    # ------------------------------------------------------------------ the DDIM step (DenoiserPolicy hooks)
    def _sampling_cond(self, prompts: list[Any]) -> dict[str, Tensor]:
        return {**self.encode_prompts(prompts),
                **self.family.micro_cond(self._size_rows(len(prompts)), self.dtype, self.device)}

    def _initial_latents(self, batch: int, generator: torch.Generator | None) -> Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        shape = (batch, self.unet.config.in_channels, self.height // self.vae_scale_factor,
                 self.width // self.vae_scale_factor)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
        return latents * self.scheduler.init_noise_sigma

    # ------------------------------------------------------------------ the DDIM step kernel's knobs
    @property
    def eta(self) -> float:
        return self.kernel.eta

    @property
    def timestep_fraction(self) -> float:
        return self.kernel.timestep_fraction

    @property
    def trainable_steps(self) -> Tensor:
        return self.kernel.trainable_steps

    def _trained_steps_mask(self, batch: int, generator: torch.Generator | None) -> Tensor:
        return self.kernel.trained_steps_mask(batch, generator)

    # ------------------------------------------------------------------ Diffusion-DPO pairs (hooks)
    def _side_cond(self, sizes: tuple, crops: tuple, resolution: int) -> dict[str, Tensor]:
        rows_6 = [[*s, *c, resolution, resolution] for s, c in zip(sizes, crops)]
        return self.family.micro_cond(rows_6, self.dtype, self.device)

    def _draw_pair_times(self, batch: int) -> dict[str, Tensor]:
        """One DDPM training timestep t ~ U{0..T-1} per pair (Diffusion-DPO)."""
        return {"timesteps": torch.randint(0, self.scheduler.config.num_train_timesteps, (batch,),
                                           generator=self.generator)}

    def _pair_times(self, payload: dict[str, Any], batch: int) -> Tensor:
        t_B = payload.get("timesteps")
        if t_B is None:
            t_B = self._draw_pair_times(batch)["timesteps"]
        return torch.as_tensor(t_B).long().to(self.device)

    def _noised(self, x0: Tensor, eps: Tensor, t_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps (the scheduler's ``add_noise``) for the doubled batch, and the
        target of the scheduler's ``prediction_type``: eps, v = sqrt(a_t) eps - sqrt(1 - a_t) x0, or x0."""
        t2 = torch.cat([t_B, t_B])
        return self.scheduler.add_noise(x0, eps, t2), t2, self._target(x0, eps, t2)

    def _target(self, x0: Tensor, eps: Tensor, t: Tensor) -> Tensor:
        """What the UNet predicts at x_t under the scheduler's ``prediction_type``: eps, v = sqrt(a_t) eps -
        sqrt(1 - a_t) x0 (``get_velocity``), or x0; ValueError for any other type."""
        kind = self.scheduler.config.prediction_type
        if kind == "epsilon":
            return eps
        if kind == "v_prediction":
            return self.scheduler.get_velocity(x0, eps, t)
        if kind == "sample":
            return x0
        raise ValueError(f"unsupported prediction_type {kind!r}")

    is_flow_matching = False

    def _forward_process(self, x0: Tensor, eps: Tensor, t_R: Tensor) -> dict[str, Tensor]:
        """x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps at DDPM timesteps ``t_R`` [R] (the scheduler's ``add_noise``),
        the target of its ``prediction_type`` (eps, v or x0), and alpha = sqrt(a_t), sigma = sqrt(1 - a_t) [R]
        (sigma: the noise level a forward-process weighting reads)."""
        t = t_R.long().to(self.device)
        acp = self.scheduler.alphas_cumprod.to(self.device, torch.float32)[t]
        alpha, sigma = acp.sqrt(), (1 - acp).sqrt()
        return {"x_t": self.scheduler.add_noise(x0, eps, t), "target": self._target(x0, eps, t), "alpha": alpha,
                "sigma": sigma}

    def _x0_from(self, pred: Tensor, p: dict[str, Tensor]) -> Tensor:
        """The clean-image estimate from a prediction at ``p["x_t"]`` (``_forward_process``'s values)."""
        view = (-1,) + (1,) * (pred.dim() - 1)
        alpha, sigma, x_t = p["alpha"].view(view), p["sigma"].view(view), p["x_t"].float()
        kind = self.scheduler.config.prediction_type
        if kind == "epsilon":
            return (x_t - sigma * pred) / alpha
        if kind == "v_prediction":
            return alpha * x_t - sigma * pred
        return pred

    def _pair_side_cond(self, batch: PreferenceBatch, latent_shape: torch.Size) -> dict[str, Tensor]:
        """Per-side micro-conditioning (SDXL time_ids) from the batch's sides, default: the latent's pixel
        size, no crop."""
        b = latent_shape[0]
        size = (latent_shape[-2] * self.vae_scale_factor, latent_shape[-1] * self.vae_scale_factor)
        default = self.family.micro_cond(self._size_rows(b, target_size=size), self.dtype, self.device)
        cond = {}
        for key, value in default.items():
            sides = [side.get(key) for side in (batch.chosen, batch.rejected)]
            cond[key] = torch.cat([value if s is None else s.to(self.device, self.dtype) for s in sides])
        return cond

    # ------------------------------------------------------------------ saving
    def _lora_layers(self, peft_state: dict[str, Tensor]) -> dict[str, Tensor]:
        from diffusers.utils import convert_state_dict_to_diffusers

        return convert_state_dict_to_diffusers(peft_state)  # as diffusers' train_text_to_image_lora.py
