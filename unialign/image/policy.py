"""``DiffusionPolicy``: Stable Diffusion 1.x / SDXL behind the modality-neutral ``Policy`` protocol.

The policy is one shared DDIM part (trajectory recording, per-step log-probs over the trained steps, the
reference, LoRA, saving, preference batches) and one small family adapter chosen at construction:
``SD1Family`` (one CLIP encoder, the UNet conditions on ``prompt_embeds`` only) or ``SDXLFamily`` (two CLIP
encoders, plus ``added_cond_kwargs`` with the pooled embedding and the size micro-conditioning ``time_ids``).
The adapter encodes prompts, builds the UNet's extra conditioning, names the payload's condition keys and
the diffusers pipeline class; the shared code never asks which family it runs.

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

import contextlib
import copy
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from PIL import Image

from unialign.algos.kl import gaussian_kl
from unialign.image.ddim import (
    HALF_LOG_2PI,
    ddim_step_coefficients,
    ddim_step_mean,
    ddim_step_with_logprob,
    gaussian_logprob_mean,
)
from unialign.policy import ReferencePolicy
from unialign.types import PreferenceBatch, Trajectory

Tensor = torch.Tensor

LORA_TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0"]


class DenoiserPolicy:
    """What ``DiffusionPolicy`` (UNet, DDIM) and ``FlowMatchingPolicy`` (SD3 transformer, SDE step) share: the
    denoiser (``self.denoiser``: the one trainable module) made trainable in full or through LoRA, the frozen
    text encoders / VAE, chunked sampling and step-chunked training, the adapters-off reference switch, and
    the hub load options. A subclass implements ``_sample(model, prompts, generator)``."""

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

    @staticmethod
    def _hub_options(path_or_hub_id: str) -> tuple[dict[str, Any], bool]:
        """(``from_pretrained`` options, offline?): ``local_files_only`` when offline and not a local folder."""
        from huggingface_hub import constants as hub_constants

        offline = hub_constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        return ({"local_files_only": True} if (offline and not os.path.isdir(path_or_hub_id)) else {}), offline

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    @torch.no_grad()
    def sample(self, prompts: list[Any], generator: torch.Generator | None = None,
               record_logp: bool = True) -> Trajectory:
        """One image per prompt, recording every latent, the timesteps, the conditioning and each step's
        log-prob (the subclass's ``_sample``). The log-probs come free with each step, so ``record_logp`` is
        ignored. With ``sample_batch_size`` the prompts are denoised in chunks of that many."""
        size = self.sample_batch_size
        if size <= 0 or len(prompts) <= size:
            return self._sample(self.model, prompts, generator)
        return Trajectory.cat([self._sample(self.model, list(prompts[i:i + size]), generator)
                               for i in range(0, len(prompts), size)])

    #: classifier-free guidance in training: True computes the gradient through both branches of u + w (c - u)
    #: (DDPO as published, one doubled batch); False computes the unconditional u under no_grad on its own
    #: (Flow-GRPO's training step: no gradient through u, its activations never kept). Sampling and the
    #: recomputed log-prob values are the same either way. Set by the subclasses' constructors.
    cfg_uncond_grad: bool = True

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

    @contextlib.contextmanager
    def _adapters_disabled(self) -> Iterator[None]:
        self.denoiser.disable_adapters()
        try:
            yield
        finally:
            self.denoiser.enable_adapters()


def tokenize(tokenizer, prompts: list[str], device: torch.device) -> Tensor:
    """Token ids [B, L] of ``prompts``, padded / truncated to the tokenizer's ``model_max_length``, on ``device``."""
    return tokenizer(list(prompts), padding="max_length", max_length=tokenizer.model_max_length,
                     truncation=True, return_tensors="pt").input_ids.to(device)


def time_ids_from_rows(rows: list[list[int]], dtype: torch.dtype, device: torch.device) -> Tensor:
    """SDXL micro-conditioning [B, 6] from one row (orig_h, orig_w, crop_top, crop_left, target_h, target_w)
    per image (Podell et al. 2023, sec. 2.2; diffusers ``StableDiffusionXLPipeline._get_add_time_ids``)."""
    return torch.tensor(rows, dtype=dtype, device=device)


class UNetFamily:
    """What ``DiffusionPolicy``'s shared DDIM code asks of a pipeline family (``SD1Family``, ``SDXLFamily``):
    the frozen text encoders and how to encode prompts, the per-image size micro-conditioning, the UNet's
    ``added_cond_kwargs``, the payload's condition keys and the stock diffusers pipeline class.

    Class attributes:
        is_sdxl: which family (for callers; the shared code does not read it).
        text_keys: what ``encode_prompts`` returns (``prompt_embeds`` [B, L, D], ...).
        micro_keys: what ``micro_cond`` returns (per-image size conditioning).
        cond_keys: ``text_keys + micro_keys``, the conditioning a trajectory payload carries.
    """

    is_sdxl: bool = False
    text_keys: tuple[str, ...] = ()
    micro_keys: tuple[str, ...] = ()
    cond_keys: tuple[str, ...] = ()

    def __init__(self, text_encoder, tokenizer, text_encoder_2=None, tokenizer_2=None) -> None:
        self.text_encoder, self.tokenizer = text_encoder, tokenizer
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2

    @property
    def text_encoders(self) -> tuple:
        """The text encoders the family uses (frozen by the policy)."""
        return tuple(e for e in (self.text_encoder, self.text_encoder_2) if e is not None)

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
    def pipeline_class():
        """The stock diffusers pipeline of the family (``save_lora_weights``)."""
        raise NotImplementedError

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

    is_sdxl = False
    text_keys = ("prompt_embeds",)
    micro_keys = ()
    cond_keys = text_keys + micro_keys

    def __init__(self, text_encoder, tokenizer) -> None:
        super().__init__(text_encoder, tokenizer)

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

    @staticmethod
    def pipeline_class():
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline


class SDXLFamily(UNetFamily):
    """SDXL (``StableDiffusionXLPipeline``; Podell et al. 2023): two CLIP text encoders, the 2nd with a
    projection. ``prompt_embeds`` [B, L, D1 + D2] is both encoders' penultimate hidden states side by side;
    the UNet also takes ``added_cond_kwargs`` = {"text_embeds": ``pooled_prompt_embeds`` [B, P] (the 2nd
    encoder's projected pooled output), "time_ids": [B, 6] (original size, crop top-left, target size)}."""

    is_sdxl = True
    text_keys = ("prompt_embeds", "pooled_prompt_embeds")
    micro_keys = ("time_ids",)
    cond_keys = text_keys + micro_keys

    def __init__(self, text_encoder, tokenizer, text_encoder_2, tokenizer_2) -> None:
        if text_encoder_2 is None:
            raise ValueError("an SDXL UNet (addition_embed_type='text_time') needs text_encoder_2 and tokenizer_2")
        super().__init__(text_encoder, tokenizer, text_encoder_2, tokenizer_2)

    @staticmethod
    def describes(config: dict[str, Any]) -> bool:
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
    def pipeline_class():
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

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


def choose_family(unet, text_encoder, tokenizer, text_encoder_2=None, tokenizer_2=None) -> UNetFamily:
    """``SDXLFamily`` when a second text encoder is given or the UNet has SDXL's
    ``addition_embed_type="text_time"`` (which then needs ``text_encoder_2``), else ``SD1Family``."""
    if text_encoder_2 is not None or unet.config.get("addition_embed_type") == "text_time":
        return SDXLFamily(text_encoder, tokenizer, text_encoder_2, tokenizer_2)
    return SD1Family(text_encoder, tokenizer)


class DiffusionPolicy(DenoiserPolicy):
    """SD1.x / SDXL policy with a DDIM sampler that records per-step log-probs.

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
            last step hardly changes the image: with 8 DDIM steps at eta 1 the last two (sigma 0.04, 0.02
            against 0.3-0.8) carry 3-9x the gradient norm of the others and almost no reward signal,
            so training them is mostly noise (Flow-GRPO skips its last step for the same reason).
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
    """

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
    ) -> None:
        from diffusers import DDIMScheduler

        if eta <= 0:
            raise ValueError(f"eta must be > 0 (the step log-probability needs sigma_t > 0), got {eta}")
        if not 0.0 < timestep_fraction <= 1.0:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
        self.unet = unet
        self.cfg_uncond_grad = cfg_uncond_grad
        # decode / encode in fp32 (half-precision SD VAEs overflow to NaN)
        self.vae = vae if vae.dtype == torch.float32 else vae.to(torch.float32)
        self.family = choose_family(unet, text_encoder, tokenizer, text_encoder_2, tokenizer_2)
        self.scheduler = DDIMScheduler.from_config(scheduler.config)
        self.num_steps, self.guidance_scale, self.eta = num_steps, guidance_scale, eta
        self.scheduler.set_timesteps(num_steps)
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.height = height or unet.config.sample_size * self.vae_scale_factor
        self.width = width or unet.config.sample_size * self.vae_scale_factor
        self.timestep_fraction = timestep_fraction
        step_std = ddim_step_coefficients(self.scheduler, self.scheduler.timesteps, eta)["std"]
        self.trainable_steps = torch.nonzero(step_std >= min_step_std).flatten()
        if self.trainable_steps.numel() == 0:
            raise ValueError(f"min_step_std={min_step_std} leaves no trainable step (the largest sigma_t of "
                             f"{num_steps} steps at eta {eta} is {float(step_std.max()):.3g})")
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
        self.model = unet  # trainers may wrap it (DDP/FSDP); forward passes go through self.model
        self._frozen_unet = None
        self._uncond_cache: dict[str, Tensor] | None = None

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
        **kwargs: Any,
    ) -> DiffusionPolicy:
        """Load the components of a diffusers SD1.x / SDXL pipeline folder or hub id.

        ``sdxl=None`` detects SDXL from ``model_index.json``. ``vae_name_or_path`` swaps in another VAE
        (e.g. ``madebyollin/sdxl-vae-fp16-fix``). ``torch_dtype`` may be a name ("float16").
        ``kwargs`` go to the constructor.
        Fails at once with a RuntimeError when the weights are neither local nor downloadable
        (offline with ``HF_HUB_OFFLINE=1``, unknown id, no network).
        """
        from diffusers import AutoencoderKL, DDIMScheduler, DiffusionPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        from unialign.hub import require_hub

        if isinstance(torch_dtype, str):
            torch_dtype = getattr(torch, torch_dtype)
        for name in (path_or_hub_id, vae_name_or_path):
            if name is not None:
                require_hub(name, "model")  # fail in seconds, not after a minute of retries
        opts, offline = cls._hub_options(path_or_hub_id)
        try:
            config = DiffusionPipeline.load_config(path_or_hub_id, **opts)
            if sdxl is None:
                sdxl = SDXLFamily.describes(config)
            family = SDXLFamily if sdxl else SD1Family
            model_kw = dict(opts, torch_dtype=torch_dtype, variant=variant)
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
        except (OSError, ValueError) as e:  # hub errors (offline, 404, bad id) subclass OSError/ValueError
            raise RuntimeError(
                f"could not load diffusion weights {path_or_hub_id!r}: they are not in a local folder or the "
                f"Hugging Face cache and cannot be downloaded here (offline={offline}). Pass a local directory "
                f"holding a diffusers pipeline (model_index.json, unet/, vae/, text_encoder/, tokenizer/, "
                f"scheduler/[, text_encoder_2/, tokenizer_2/]). Cause: {type(e).__name__}: {e}"
            ) from e
        if device is not None:
            for key in ("unet", "vae", "text_encoder", "text_encoder_2"):
                if key in parts:
                    parts[key].to(device)
        return cls(**parts, lora_rank=lora_rank, **kwargs)

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The UNet's dtype: its first floating-point parameter's. (diffusers' ``unet.dtype`` says the same
        but walks every module per call: ~1 ms per sampling step on a small UNet, P4's whole overhead.)"""
        return next((p.dtype for p in self.unet.parameters() if p.is_floating_point()), torch.float32)

    @property
    def is_sdxl(self) -> bool:
        """Whether the family adapter is ``SDXLFamily`` (read-only; the shared code never branches on it)."""
        return self.family.is_sdxl

    @property
    def text_encoder(self):
        return self.family.text_encoder

    @property
    def tokenizer(self):
        return self.family.tokenizer

    @property
    def text_encoder_2(self):
        """SDXL's second text encoder (``CLIPTextModelWithProjection``); None for SD1.x."""
        return self.family.text_encoder_2

    @property
    def tokenizer_2(self):
        return self.family.tokenizer_2

    def _tokenize(self, tokenizer, prompts: list[str]) -> Tensor:
        return tokenize(tokenizer, prompts, self.device)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, Tensor]:
        """Text conditioning for ``prompts`` (no grad), the family's ``encode_prompts``. SD1.x:
        ``prompt_embeds`` = last hidden state [B, L, D]. SDXL (as the stock pipeline): ``prompt_embeds`` =
        concatenated penultimate hidden states of both encoders [B, L, D1 + D2] and ``pooled_prompt_embeds`` =
        the 2nd encoder's projected pooled output [B, P]."""
        return self.family.encode_prompts(prompts, self.device, self.dtype)

    def _uncond(self) -> dict[str, Tensor]:
        """Embeddings of the empty prompt (batch 1), cached: the CFG unconditional branch."""
        if self._uncond_cache is None:
            cond = self.encode_prompts([""])
            if self.force_zeros_for_empty_prompt:
                cond = {k: torch.zeros_like(v) for k, v in cond.items()}
            self._uncond_cache = cond
        return self._uncond_cache

    def _size_rows(self, batch: int, original_size=None, crop_top_left=(0, 0), target_size=None) -> list[list[int]]:
        """``batch`` equal rows (orig_h, orig_w, crop_top, crop_left, target_h, target_w); target defaults to
        the policy's (height, width), original to the target."""
        target = tuple(target_size or (self.height, self.width))
        return [list(original_size or target) + list(crop_top_left) + list(target)] * batch

    def time_ids(self, batch: int, original_size=None, crop_top_left=(0, 0), target_size=None) -> Tensor:
        """SDXL micro-conditioning [B, 6]: (orig_h, orig_w, crop_top, crop_left, target_h, target_w)."""
        return time_ids_from_rows(self._size_rows(batch, original_size, crop_top_left, target_size),
                                  self.dtype, self.device)

    def _predict(self, unet, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor], cfg: bool) -> Tensor:
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

    @property
    def _cfg(self) -> bool:
        return self.guidance_scale > 1.0

    def _cond_from_payload(self, payload: dict[str, Any], rows: Tensor | None = None) -> dict[str, Tensor]:
        """The family's conditioning tensors (``family.cond_keys``) of a trajectory payload, all rows or ``rows``."""
        return {k: payload[k] if rows is None else payload[k][rows] for k in self.family.cond_keys}

    def _trained_steps_mask(self, batch: int, generator: torch.Generator | None) -> Tensor:
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

    def decode(self, latents_B_C_H_W: Tensor) -> list[Image.Image]:
        """VAE-decode (fp32) latents to PIL images."""
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
        """Pixels in [-1, 1] -> latents x scaling_factor (VAE in fp32). ``sample_posterior=True`` draws
        from the VAE posterior as Diffusion-DPO does; False takes its mean (deterministic)."""
        dist = self.vae.encode(pixels_B_3_H_W.to(self.device, torch.float32)).latent_dist
        z = dist.sample(generator) if sample_posterior else dist.mean
        if getattr(self.vae.config, "shift_factor", None):
            z = z - self.vae.config.shift_factor
        return z * self.vae.config.scaling_factor

    @torch.no_grad()
    def preference_batch(self, rows: list[dict[str, Any]], resolution: int | None = None) -> PreferenceBatch:
        """Pairs from ``unialign.image.data.normalize_pickapic`` (PIL images) -> a ``PreferenceBatch``:
        each image resized / centre-cropped to ``resolution`` (default: the policy's height), VAE-encoded
        (posterior sample, fp32), SDXL ``time_ids`` from its real original size and crop; ONE timestep and
        ONE noise per pair in ``payload`` (shared by chosen, rejected, policy and reference); the prompt
        embeddings, with each caption replaced by "" with probability ``caption_dropout`` while the UNet
        is in training mode (keeps classifier-free guidance usable)."""
        from diffusers.utils.torch_utils import randn_tensor

        from unialign.image.data import to_pixels

        res = resolution or self.height
        captions = [r["prompt"] for r in rows]
        if self.caption_dropout and self.unet.training:
            drop = torch.rand(len(rows), generator=self.generator) < self.caption_dropout
            captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
        sides = []
        for key in ("chosen", "rejected"):
            pix, sizes, crops = zip(*(to_pixels(r[key], res) for r in rows))
            latents = self.encode_images(torch.stack(pix), generator=self.generator)
            rows_6 = [[*s, *c, res, res] for s, c in zip(sizes, crops)]
            sides.append({"latents": latents, **self.family.micro_cond(rows_6, self.dtype, self.device)})
        b = len(rows)
        payload = {"timesteps": torch.randint(0, self.scheduler.config.num_train_timesteps, (b,),
                                              generator=self.generator),
                   "noise": randn_tensor(tuple(sides[0]["latents"].shape), generator=self.generator,
                                         dtype=torch.float32),
                   **self.encode_prompts(captions)}
        return PreferenceBatch(prompts=captions, chosen=sides[0], rejected=sides[1], payload=payload)

    # ------------------------------------------------------------------ Policy protocol
    def _sample(self, unet, prompts: list[Any], generator: torch.Generator | None) -> Trajectory:
        from diffusers.utils.torch_utils import randn_tensor

        batch = len(prompts)
        cond = {**self.encode_prompts(prompts), **self.family.micro_cond(self._size_rows(batch), self.dtype, self.device)}
        channels = self.unet.config.in_channels
        shape = (batch, channels, self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
        latents = latents * self.scheduler.init_noise_sigma
        timesteps = self.scheduler.timesteps.to(self.device)
        # every step's coefficients at once (float64 on the host, then one copy): no host sync per step
        coefs = ddim_step_coefficients(self.scheduler, self.scheduler.timesteps, self.eta)
        coefs = {k: v.to(self.device) for k, v in coefs.items()}
        all_latents, all_logps = [latents], []
        for i, t in enumerate(timesteps):
            t_B = t.expand(batch)
            out = self._predict(unet, latents, t_B, cond, self._cfg)
            latents, logp = ddim_step_with_logprob(self.scheduler, out, t_B, latents, eta=self.eta, generator=generator,
                                                   coefficients={k: v[i].expand(batch) for k, v in coefs.items()})
            all_latents.append(latents)
            all_logps.append(logp)
        payload = {"latents": torch.stack(all_latents, dim=1), "timesteps": timesteps.expand(batch, -1).clone(), **cond}
        return Trajectory(
            prompts=list(prompts),
            completions=self.decode(latents),
            mask_B_T=self._trained_steps_mask(batch, generator).to(self.device),
            old_logp_B_T=torch.stack(all_logps, dim=1),
            truncated_B=torch.zeros(batch, dtype=torch.bool, device=self.device),
            payload=payload,
        )

    def log_prob(self, trajectory: Trajectory) -> Tensor:
        """Differentiable ``logp_B_T`` [B, N] of the recorded transitions under the current UNet, with the
        same CFG as sampling (gradients through both CFG branches, as ddpo-pytorch). Only steps with
        ``mask_B_T == 1`` are computed (all of them in one UNet call); the others are 0."""
        return self._log_prob(self.model, trajectory, False)

    def log_prob_and_entropy(self, trajectory: Trajectory) -> tuple[Tensor, Tensor]:
        """``(logp_B_T, entropy_B_T)``: ``log_prob`` and the entropy of the step Gaussian per element,
        0.5 * log(2 pi e sigma_t^2) (the same for every element, so equal to its mean over C,H,W). It does
        not depend on theta (sigma_t is fixed by the scheduler), so it carries no gradient; 0 where masked."""
        return self._log_prob(self.model, trajectory, True)

    def log_prob_and_kl(self, trajectory: Trajectory) -> tuple[Tensor, Tensor, Tensor]:
        """``(logp_B_T, entropy_B_T, kl_B_T)``: ``log_prob_and_entropy(trajectory)`` plus the closed-form
        KL of each trained step to the reference's step at the same x_t (``algos.gaussian_kl``: both are
        Gaussians with the step's sigma_t, so KL_t = mean_CHW (mu_theta - mu_ref)^2 / (2 sigma_t^2)),
        differentiable through mu_theta; 0 where masked. The reference (``reference()``: adapters off, or
        the frozen copy) runs here, without gradients, with the same CFG -- as Flow-GRPO's training step
        does -- so the trainer needs no reference pass of its own."""
        return self._log_prob(self.model, trajectory, True, reference=self.reference())

    def _log_prob(self, unet, trajectory: Trajectory, with_entropy: bool, reference: Any = None) -> Any:
        """Every trained (sample, step) pair of the batch in ONE UNet call (each row its own x_t, t and
        conditioning): a micro-batch's trained steps are scattered over the N columns, and a call per
        column runs the UNet on a few rows at a time."""
        payload = trajectory.payload
        latents, timesteps = payload["latents"], payload["timesteps"]
        mask = trajectory.mask_B_T
        batch, steps = timesteps.shape
        logp_B_T = torch.zeros(batch, steps, device=latents.device, dtype=torch.float32)
        kl_B_T = torch.zeros_like(logp_B_T)
        rows, cols = (mask.to(latents.device) > 0).nonzero(as_tuple=True)
        if rows.numel() > 0:
            t_R, x_R, cond = timesteps[rows, cols], latents[rows, cols], self._cond_from_payload(payload, rows)
            out = self._predict(unet, x_R, t_R, cond, self._cfg)
            mean, std = ddim_step_mean(self.scheduler, out, t_R, x_R, self.eta)
            logp_B_T = logp_B_T.index_put((rows, cols), gaussian_logprob_mean(latents[rows, cols + 1].detach().float(),
                                                                              mean, std))
            if reference is not None:
                with reference._frozen():
                    ref_out = self._predict(reference.model, x_R, t_R, cond, self._cfg)
                ref_mean, _ = ddim_step_mean(self.scheduler, ref_out, t_R, x_R, self.eta)
                kl_B_T = kl_B_T.index_put((rows, cols), gaussian_kl(mean, ref_mean, std))
        if not with_entropy:
            return logp_B_T
        std_B_T = ddim_step_coefficients(self.scheduler, timesteps.reshape(-1), self.eta)["std"].view(batch, steps)
        entropy_B_T = (0.5 + HALF_LOG_2PI + torch.log(std_B_T.to(logp_B_T.device))) * (mask > 0)
        if reference is None:
            return logp_B_T, entropy_B_T
        return logp_B_T, entropy_B_T, kl_B_T

    def sequence_log_prob(self, batch: PreferenceBatch, length_normalize: bool = False) -> tuple[Tensor, Tensor]:
        """Diffusion-DPO ELBO **surrogate** (Wallace et al. 2023, eq. 14 as implemented in
        SalesforceAIResearch/DiffusionDPO ``train.py``), NOT the log-likelihood of the image:

            logp = -1/2 * mean_CHW || target - UNet(x_t, t, c) ||^2,   x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps

        with target = eps (v = sqrt(a_t) eps - sqrt(1 - a_t) x0 for v-prediction). One t ~ U{0..T-1} and one
        eps per pair are shared by the chosen and rejected latents, so identical images give identical
        values. Reads ``batch.chosen["latents"]`` / ``batch.rejected["latents"]`` [B, C, H, W] (VAE-encoded
        x scaling_factor, see ``encode_images``), optionally ``batch.payload["timesteps"]`` [B] and
        ``["noise"]`` [B, C, H, W] (else drawn from the policy's generator), ``["prompt_embeds"]``
        (+ ``pooled_prompt_embeds`` for SDXL; else the prompts are encoded) and per-side SDXL
        ``time_ids`` [B, 6] (default: the latent size, no crop). No CFG. Returns (chosen_B, rejected_B).
        """
        return self._sequence_log_prob(self.model, batch, length_normalize)

    def _sequence_log_prob(self, unet, batch: PreferenceBatch, length_normalize: bool = False) -> tuple[Tensor, Tensor]:
        from diffusers.utils.torch_utils import randn_tensor

        chosen = batch.chosen["latents"].to(self.device, torch.float32)
        rejected = batch.rejected["latents"].to(self.device, torch.float32)
        b = chosen.shape[0]
        t_B = batch.payload.get("timesteps")
        if t_B is None:
            t_B = torch.randint(0, self.scheduler.config.num_train_timesteps, (b,), generator=self.generator)
        t_B = torch.as_tensor(t_B).long().to(self.device)
        noise = batch.payload.get("noise")
        if noise is None:
            noise = randn_tensor(chosen.shape, generator=self.generator, dtype=torch.float32)
        noise = noise.to(self.device, torch.float32)

        if "prompt_embeds" in batch.payload:
            cond = {k: batch.payload[k].to(self.device, self.dtype) for k in self.family.text_keys if k in batch.payload}
        else:
            cond = self.encode_prompts(batch.prompts)
        cond = {k: torch.cat([v, v]) for k, v in cond.items()}
        # per-side micro-conditioning (SDXL time_ids), default: the latent's pixel size, no crop
        size = (chosen.shape[-2] * self.vae_scale_factor, chosen.shape[-1] * self.vae_scale_factor)
        default = self.family.micro_cond(self._size_rows(b, target_size=size), self.dtype, self.device)
        for key, value in default.items():
            sides = [side.get(key) for side in (batch.chosen, batch.rejected)]
            cond[key] = torch.cat([value if s is None else s.to(self.device, self.dtype) for s in sides])

        x0 = torch.cat([chosen, rejected])
        eps, t2 = torch.cat([noise, noise]), torch.cat([t_B, t_B])
        x_t = self.scheduler.add_noise(x0, eps, t2)
        pred = self._predict(unet, x_t, t2, cond, cfg=False).float()
        kind = self.scheduler.config.prediction_type
        if kind == "epsilon":
            target = eps
        elif kind == "v_prediction":
            target = self.scheduler.get_velocity(x0, eps, t2)
        elif kind == "sample":
            target = x0
        else:
            raise ValueError(f"unsupported prediction_type {kind!r}")
        logp = -0.5 * ((target - pred) ** 2).mean(dim=(1, 2, 3))
        return logp[:b], logp[b:]

    def reference(self) -> ReferencePolicy:
        """The frozen reference: the same UNet with LoRA adapters disabled, or (full fine-tuning) a frozen
        deep copy made on the first call; call it before training starts."""
        if self.lora_rank > 0:
            return ReferencePolicy(self, None, self._adapters_disabled)  # the policy's own (wrapped) UNet
        if self._frozen_unet is None:
            self._frozen_unet = copy.deepcopy(self.unet).requires_grad_(False).eval()
        return ReferencePolicy(self, self._frozen_unet)

    def save(self, path: str) -> None:
        """LoRA: ``pytorch_lora_weights.safetensors`` in ``path``, loadable with stock
        ``StableDiffusion[XL]Pipeline.load_lora_weights(path)``. Full fine-tuning: the UNet in
        ``path/unet`` (``UNet2DConditionModel.from_pretrained(path, subfolder="unet")``). Called on every
        process; the main process writes."""
        from unialign.dist import is_main_rank

        if not is_main_rank():
            return
        os.makedirs(path, exist_ok=True)
        if self.lora_rank == 0:
            self.unet.save_pretrained(os.path.join(path, "unet"))
            return
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(self.unet))
        metadata = self.unet.peft_config["default"].to_dict()
        metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
        self.family.pipeline_class().save_lora_weights(path, unet_lora_layers=layers, unet_lora_adapter_metadata=metadata)


