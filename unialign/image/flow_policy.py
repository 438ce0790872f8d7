"""Flow-matching policies behind the ``Policy`` protocol: ``FlowPolicyBase`` (the flow-matching step every family
shares, and the one constructor) with one family adapter given as ``family=``: ``SD3Family`` (here),
``FluxFamily`` (``unialign.image.flux_policy``) or ``ZImageFamily`` (``unialign.image.zimage``), all on one
``FlowFamily`` interface -- as ``DiffusionPolicy`` holds ``SD1Family`` / ``SDXLFamily``
(``unialign.image.policy``). ``FlowMatchingPolicy`` (SD3 / SD3.5) and ``unialign.image.flux_policy.FluxPolicy``
(FLUX.1) are ``FlowPolicyBase`` with their family's adapter, kept as names.

A trajectory is the N steps x_1 -> ... -> x_0 of diffusers' ``FlowMatchEulerDiscreteScheduler`` made
stochastic by Flow-GRPO's SDE step (``unialign.image.flow.sde_step_with_logprob``, "sde" or "cps"); the
per-step log-prob is that step's Gaussian log-density averaged over C,H,W (the DDPO convention of
``DiffusionPolicy``). With an SDE window (Flow-GRPO-Fast / MixGRPO) only the steps inside the window are
stochastic and trained (``mask_B_T`` 1); the others are deterministic Euler steps x + v dt (mask 0, log-prob 0).
A step of std 0 (the last "cps" step) is deterministic too: mask 0, as Flow-GRPO never trains its last step.
The transformer (``self.model``) is the only trainable module; VAE and text encoders are frozen.

``FlowPolicyBase`` is the flow-matching step on the shared denoiser part (``unialign.image.denoiser``:
sampling, the step log-probs, the KL to the reference, the Diffusion-DPO surrogate, the reference and saving
are written once there). What differs per family is its adapter's (``self.family``, a ``FlowFamily``): prompt
encoding (``encode_prompts``), the velocity of one transformer call (``velocity``: CFG, packing, the guidance
embedding), the latent shape, the pixel multiple and the image-token count, the sampling sigmas
(``set_timesteps``), the stock pipeline class, the LoRA target modules, the defaults of the guidance scale, the
text length and the image size, and the text parts ``from_pretrained`` loads. The adapter is given once
(``unialign.image.families.choose_flow_family`` finds it from a transformer); the shared code never asks which
family it runs.

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

from unialign.image.denoiser import DenoiserPolicy, decode_images, encode_images
from unialign.image.family import ImageFamily, SamplerKnobs
from unialign.image.kernels import FlowSDEKernel
from unialign.policy import KLWeights
from unialign.types import Trajectory

Tensor = torch.Tensor

# the attention projections of SD3's joint blocks (diffusers' train_dreambooth_lora_sd3.py default)
SD3_LORA_TARGET_MODULES = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
COND_KEYS = ("prompt_embeds", "pooled_prompt_embeds")


class FlowFamily(ImageFamily):
    """What ``FlowPolicyBase``'s shared flow-matching code asks of a transformer family (``SD3Family``,
    ``FluxFamily``, ``ZImageFamily``): the frozen text parts (held by name, ``ImageFamily``) and how to encode
    prompts, the velocity of one transformer call, the latent geometry and the sampling sigmas, the LoRA targets,
    the family's defaults and the text parts ``from_pretrained`` loads. The geometry hooks read the transformer's
    config (``self.config``, held from construction) and are told the sizes; ``velocity`` is given the policy (its
    ``dtype``, ``guidance_scale`` and the CFG helpers ``_cfg``, ``_uncond``, ``_guided`` of ``DenoiserPolicy``).

    Class attributes (beyond ``ImageFamily``'s, which are the family's row):
        transformer_class: the diffusers transformer class the family runs (``describes``, ``from_pretrained``).
        text_keys: what ``encode_prompts`` returns (e.g. ``prompt_embeds`` [B, L, D], ``pooled_prompt_embeds``).
        cond_keys: the conditioning a trajectory payload carries (here: ``text_keys``).
        lora_target_modules: the transformer modules a LoRA adapts (diffusers' LoRA training script's default).
        guidance_scale, max_sequence_length: the defaults of the policy keywords of those names (the stock
            pipeline's), used when they are left None.
        t5_optional: whether ``from_pretrained(load_t5=False)`` may leave the optional text parts out.
        layout: the pipeline folder ``from_pretrained`` reads (for its error message).
    """

    policy = "unialign.image.flow_policy:FlowPolicyBase"
    kernel = "flow_sde"
    knobs = (*FlowSDEKernel.knobs, "max_sequence_length")
    transformer_class: str = ""
    text_keys: tuple[str, ...] = COND_KEYS
    cond_keys: tuple[str, ...] = COND_KEYS
    lora_target_modules: list[str] = []
    guidance_scale: float
    max_sequence_length: int
    t5_optional: bool = False
    layout: str = ""
    #: the diffusers VAE class of the pipeline folder (``from_pretrained``)
    vae_class: str = "AutoencoderKL"

    def __init__(self, transformer, **parts: Any) -> None:
        self.config = transformer.config
        super().__init__(**parts)

    @classmethod
    def describes(cls, transformer) -> bool:
        """Whether ``transformer`` is the family's: an instance of ``transformer_class`` or of a subclass of it
        (compared by name: deciding imports no diffusers)."""
        return any(c.__name__ == cls.transformer_class for c in type(transformer).__mro__)

    def defaults(self, knobs: SamplerKnobs, vae_scale_factor: int) -> SamplerKnobs:
        """``knobs`` with the family's defaults where they are unset: ``guidance_scale`` and
        ``max_sequence_length`` when None, ``height`` / ``width`` = ``default_size`` when None or 0."""
        size = self.default_size(vae_scale_factor)
        return replace(knobs, height=knobs.height or size, width=knobs.width or size,
                       guidance_scale=self.guidance_scale if knobs.guidance_scale is None else knobs.guidance_scale,
                       max_sequence_length=(self.max_sequence_length if knobs.max_sequence_length is None
                                            else knobs.max_sequence_length))

    def check_vae(self, vae) -> None:
        """ValueError when ``vae`` lacks what the family needs (nothing here)."""

    @staticmethod
    def vae_scale_factor(vae) -> int:
        """Pixels per latent pixel along a side: 2 ** (VAE levels - 1), as the stock image pipelines."""
        return 2 ** (len(vae.config.block_out_channels) - 1)

    @staticmethod
    def flow_scheduler(scheduler):
        """The ``FlowMatchEulerDiscreteScheduler`` the policy samples with: ``scheduler`` itself, or built from the
        config of any other scheduler (or from a scheduler config dict, a folder's ``scheduler_config.json``)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            return scheduler
        return FlowMatchEulerDiscreteScheduler.from_config(getattr(scheduler, "config", scheduler))

    def decode(self, vae, latents: Tensor) -> list:
        """The completions of clean latents [B, C, H, W]: B PIL images (``denoiser.decode_images``)."""
        return decode_images(vae, latents)

    def encode(self, vae, pixels: Tensor, sample_posterior: bool, generator: torch.Generator | None) -> Tensor:
        """Latents of pixels [B, 3, H, W] in [-1, 1] (``denoiser.encode_images``: the Diffusion-DPO pairs)."""
        return encode_images(vae, pixels, sample_posterior, generator)

    def sampling_extras(self) -> dict[str, Any]:
        """Stock pipeline call arguments beyond steps, guidance and size that the policy samples with (none here)."""
        return {}

    # ------------------------------------------------------------------ hooks
    def default_size(self, vae_scale_factor: int) -> int:
        """The image side in pixels when height / width are unset (the stock pipeline's default)."""
        raise NotImplementedError

    def pixel_multiple(self, vae_scale_factor: int) -> int:
        """Image sides must be multiples of this: the VAE factor x the transformer's patch (x2 where the latents
        are packed 2x2)."""
        raise NotImplementedError

    def latent_shape(self, batch: int, height: int, width: int, vae_scale_factor: int) -> tuple[int, int, int, int]:
        """(B, C, H, W) of the unpacked latents of ``height`` x ``width`` images."""
        raise NotImplementedError

    def image_tokens(self, height: int, width: int, vae_scale_factor: int) -> int:
        """The image tokens the transformer sees for ``height`` x ``width`` images (the sequence length of the
        dynamic timestep shift)."""
        raise NotImplementedError

    def set_timesteps(self, scheduler, num_steps: int, image_tokens: int) -> None:
        """``scheduler.set_timesteps`` for ``num_steps`` sampling steps as the stock pipeline does for an image of
        ``image_tokens`` tokens."""
        raise NotImplementedError

    def encode_prompts(self, prompts: list[str], device: torch.device, dtype: torch.dtype,
                       max_sequence_length: int) -> dict[str, Tensor]:
        """``text_keys`` tensors for ``prompts``, each with leading B, in ``dtype`` on ``device``
        (``max_sequence_length``: the T5 tokens)."""
        raise NotImplementedError

    def velocity(self, policy: FlowPolicyBase, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor],
                 cfg: bool) -> Tensor:
        """The velocity v [B, C, H, W] (unpacked) of ``model`` (the policy's or the reference's transformer) at
        latents [B, C, H, W] and scheduler timesteps t_B [B] (sigma x 1000) under ``cond`` (``cond_keys``, B rows);
        ``cfg=False`` turns classifier-free guidance off (the DPO surrogate)."""
        raise NotImplementedError

    @staticmethod
    def load_text_parts(path_or_hub_id: str, opts: dict[str, Any], model_kw: dict[str, Any],
                        load_t5: bool) -> dict[str, Any]:
        """The text encoders and tokenizers of a pipeline folder, by constructor name (``from_pretrained``)."""
        raise NotImplementedError


class FlowPolicyBase(DenoiserPolicy, KLWeights):
    """A flow-matching policy: the flow-matching step on the shared denoiser part (``DenoiserPolicy``: module
    docstring) and one family adapter, ``self.family`` (``FlowFamily``), given once as ``family=``.
    ``FlowMatchingPolicy`` (SD3) and ``FluxPolicy`` (FLUX.1) are this class with the family given
    (``family_class``), kept as names.

    Args:
        transformer: the family's diffusers transformer (``SD3Transformer2DModel``, ``FluxTransformer2DModel``,
            ``ZImageTransformer2DModel``).
        vae: ``AutoencoderKL`` (decoded in fp32).
        scheduler: a ``FlowMatchEulerDiscreteScheduler`` (any other is converted with the same config).
        **text_parts: the family's text encoders and tokenizers by their diffusers component names (its
            ``text_parts`` and ``optional_parts``: SD3 ``text_encoder`` .. ``tokenizer_3``, FLUX.1 ``text_encoder``
            .. ``tokenizer_2``, Z-Image ``text_encoder`` and ``tokenizer``); ValueError naming a part it does not
            take or lacks.
        num_steps: N sampling steps.
        guidance_scale: the guidance weight w; None: the family's default (``FlowFamily.guidance_scale``: SD3 4.5,
            FLUX.1 3.5). SD3: CFG (> 1 turns it on, in sampling and in the recomputed log-prob, one doubled batch;
            never in the DPO surrogate). FLUX.1: the distilled guidance embedding, never CFG.
        noise_level: eta of the SDE step (Flow-GRPO: 0.7 for "sde", 0.8 for "cps").
        sde_type: "sde" or "cps" (``unialign.image.flow``).
        sde_window_size: 0 (default): every step is stochastic and trained. k > 0: per ``sample`` call one
            window of k consecutive steps, starting at a step drawn uniformly (from the sampling generator)
            in [lo, hi - k] with (lo, hi) = ``sde_window_range`` (default (0, N)); only these steps are
            stochastic and trained (Flow-GRPO-Fast).
        height, width: image size in pixels, multiples of the family's ``pixel_multiple``; None (or 0): the
            family's ``default_size`` (the stock pipeline's).
        max_sequence_length: T5 tokens (SD3: also the zero block's length when T5 is None); None: the family's
            default (``FlowFamily.max_sequence_length``: SD3 256, FLUX.1 512).
        num_frames: frames per video of a video family (``WanFamily``: 4k + 1; None: its default); an image
            family takes none.
        lora_rank: > 0 adds a peft LoRA (alpha = ``lora_alpha`` or rank) on the family's
            ``lora_target_modules`` and freezes the base; 0 trains the full transformer. ``save``
            (``DenoiserPolicy.save``): the LoRA in ``load_lora_weights`` form, or a whole stock pipeline folder
            (the family's ``pipeline_class``; SD3 without T5 when the policy has none).
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
            FLUX.1 has no CFG: accepted for the image scripts' one interface.
        knobs: the sampler knobs as one frozen value (``unialign.image.families.SamplerKnobs``); its set fields
            replace the keywords of the same name (``self.knobs``: the values used, the family's defaults filled in).
        family: the adapter class (a ``FlowFamily`` subclass: ``SD3Family``, ``FluxFamily``, ``ZImageFamily``); None:
            ``family_class`` (``FlowMatchingPolicy``, ``FluxPolicy``). ``unialign.image.families.choose_flow_family``
            finds it from a transformer. A class with ``family_class`` refuses another adapter.
    """

    denoiser_subfolder = "transformer"
    #: the adapter a subclass kept as a family's name gives (None: ``family=`` says)
    family_class: type[FlowFamily] | None = None

    def __init__(
        self,
        transformer,
        vae,
        *,
        scheduler,
        num_steps: int = 10,
        guidance_scale: float | None = None,
        noise_level: float = 0.7,
        sde_type: str = "sde",
        sde_window_size: int = 0,
        sde_window_range: tuple[int, int] | None = None,
        height: int | None = None,
        width: int | None = None,
        max_sequence_length: int | None = None,
        num_frames: int | None = None,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
        gradient_checkpointing: bool = False,
        sample_batch_size: int = 0,
        train_chunk_size: int = 0,
        seed: int = 0,
        caption_dropout: float = 0.0,
        cfg_uncond_grad: bool = False,
        knobs: SamplerKnobs | None = None,
        family: type[FlowFamily] | None = None,
        **text_parts: Any,
    ) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.family = self._choose_family(transformer, family)(transformer, **text_parts)
        self.family.check_vae(vae)
        self.vae_scale_factor = self.family.vae_scale_factor(vae)
        k = SamplerKnobs.over(knobs, num_steps=num_steps, guidance_scale=guidance_scale, noise_level=noise_level,
                              sde_type=sde_type, sde_window_size=sde_window_size, sde_window_range=sde_window_range,
                              height=height, width=width, max_sequence_length=max_sequence_length,
                              num_frames=num_frames)
        self.knobs = k = self.family.defaults(k, self.vae_scale_factor)
        self.kernel = FlowSDEKernel(k.num_steps, k.noise_level, k.sde_type, k.sde_window_size, k.sde_window_range)
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1], got {caption_dropout}")
        self.transformer = transformer
        self.vae = vae if vae.dtype == torch.float32 else vae.to(torch.float32)
        self.scheduler = self.family.flow_scheduler(scheduler)
        # the training timesteps / sigmas (num_train_timesteps of them, before set_timesteps), as the
        # diffusers training scripts' ``noise_scheduler_copy``: the Diffusion-DPO surrogate draws from them
        train = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)
        self.train_timesteps = train.timesteps.detach().float().cpu()
        self.train_sigmas = train.sigmas.detach().float().cpu()[: len(self.train_timesteps)]
        self.num_steps, self.guidance_scale = k.num_steps, k.guidance_scale
        self.height, self.width = k.height, k.width
        self._check_size()
        self.max_sequence_length = k.max_sequence_length
        self.generator = torch.Generator().manual_seed(seed)
        self.caption_dropout = caption_dropout
        self.cfg_uncond_grad = cfg_uncond_grad
        self._set_timesteps()
        self._setup_denoiser(transformer, (self.vae, *self.family.text_encoders), lora_rank=lora_rank,
                             lora_alpha=lora_alpha, target_modules=self.family.lora_target_modules,
                             gradient_checkpointing=gradient_checkpointing, sample_batch_size=sample_batch_size,
                             train_chunk_size=train_chunk_size)

    def _choose_family(self, transformer, family: type[FlowFamily] | None) -> type[FlowFamily]:
        """``family``, else ``family_class``; TypeError without either, ValueError when the transformer is not the
        adapter's or this class holds another."""
        pin = self.family_class
        chosen = family or pin
        if chosen is None:
            raise TypeError(f"{type(self).__name__} needs family= (a FlowFamily: SD3Family, FluxFamily, ZImageFamily, "
                            f"...; unialign.image.families.choose_flow_family({type(transformer).__name__}) finds it)")
        if pin is not None and not issubclass(chosen, pin):
            raise ValueError(f"{type(self).__name__} runs the {pin.title} family, not the {chosen.title} family: "
                             f"build FlowPolicyBase(family={chosen.__name__}) for it")
        if not chosen.describes(transformer):
            raise ValueError(f"{type(self).__name__} with the {chosen.title} family runs a {chosen.transformer_class}, "
                             f"not {type(transformer).__name__} (unialign.image.families.choose_flow_family finds "
                             f"the family of a transformer)")
        return chosen

    def _check_size(self) -> None:
        multiple = self._pixel_multiple()
        if self.height % multiple or self.width % multiple:
            scale = self.vae_scale_factor
            raise ValueError(f"height and width (--resolution) must be multiples of {multiple} for {type(self).__name__} "
                             f"(the VAE factor {scale} x the transformer's {multiple // scale}x{multiple // scale} "
                             f"patches), got {self.height} x {self.width}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, lora_rank: int = 0, torch_dtype: torch.dtype | str | None = None,
                        device: str | torch.device | None = None, *, load_t5: bool = True, variant: str | None = None,
                        family: type[FlowFamily] | None = None, **kwargs: Any) -> FlowPolicyBase:
        """Load the parts of the family's stock pipeline folder or hub id (``family``, else ``family_class``;
        ``unialign.image.families.resolve`` finds it from the folder's ``model_index.json`` or the hub id):
        the transformer (the family's ``transformer_class``), the VAE, the scheduler and the family's text parts
        (``load_text_parts``). ``load_t5=False`` (or an SD3 folder without ``text_encoder_3``) leaves an optional
        T5 out (SD3: zeros, as the stock pipeline allows). ``kwargs`` go to the constructor. Fails at once with a
        RuntimeError when the weights are neither local nor downloadable (offline, unknown id, no network)."""
        family = family or cls.family_class
        if family is None:
            raise TypeError(f"{cls.__name__}.from_pretrained needs family= (unialign.image.families.resolve(path) "
                            "finds it; ImageFamily.load(path) loads with it)")
        if not load_t5 and not family.t5_optional:
            raise ValueError(f"load_t5=False: {family.title} cannot leave T5 out (its prompt embeddings are T5's)")

        def build(opts: dict, model_kw: dict) -> dict[str, Any]:
            import diffusers

            transformer = getattr(diffusers, family.transformer_class)
            return {
                "transformer": transformer.from_pretrained(path_or_hub_id, subfolder="transformer", **model_kw),
                "vae": getattr(diffusers, family.vae_class).from_pretrained(path_or_hub_id, subfolder="vae", **opts),
                **family.load_text_parts(path_or_hub_id, opts, model_kw, load_t5),
                "scheduler": family.flow_scheduler(diffusers.FlowMatchEulerDiscreteScheduler.load_config(
                    path_or_hub_id, subfolder="scheduler", **opts)),
            }

        parts = cls._load_parts(path_or_hub_id, build, family.title, family.layout, torch_dtype, variant, device)
        return cls(**parts, lora_rank=lora_rank, family=family, **kwargs)

    # ------------------------------------------------------------------ family
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, Tensor]:
        """``prompt_embeds`` [B, L, D] and ``pooled_prompt_embeds`` [B, P] (no grad): the family's
        ``encode_prompts`` with the policy's ``max_sequence_length``."""
        return self.family.encode_prompts(prompts, self.device, self.dtype, self.max_sequence_length)

    def _denoise(self, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor], cfg: bool = True) -> Tensor:
        """The velocity v [B, C, H, W] (unpacked) of ``model`` at (latents [B, C, H, W], scheduler timesteps
        t_B [B]): the family's ``velocity``; ``cfg=False`` turns classifier-free guidance off (the DPO surrogate)."""
        return self.family.velocity(self, model, latents, t_B, cond, cfg)

    def _latent_shape(self, batch: int) -> tuple[int, int, int, int]:
        """(B, C, H, W) of the unpacked latents of ``height`` x ``width`` images (the family's)."""
        return self.family.latent_shape(batch, self.height, self.width, self.vae_scale_factor)

    def _pixel_multiple(self) -> int:
        return self.family.pixel_multiple(self.vae_scale_factor)

    def _set_timesteps(self) -> None:
        """``self.scheduler.set_timesteps`` for ``num_steps`` as the family's stock pipeline does."""
        tokens = self.family.image_tokens(self.height, self.width, self.vae_scale_factor)
        self.family.set_timesteps(self.scheduler, self.num_steps, tokens)

    def _pipeline_class(self):
        """The stock diffusers pipeline class (its ``save_lora_weights`` / ``load_lora_weights``): the family's."""
        return self.family.pipeline_class()

    def decode(self, latents: Tensor) -> list:
        """The completions of clean latents (the family's ``decode``: PIL images, or videos as lists of frames)."""
        return self.family.decode(self.vae, latents)

    @torch.no_grad()
    def encode_images(self, pixels_B_3_H_W: Tensor, sample_posterior: bool = True,
                      generator: torch.Generator | None = None) -> Tensor:
        """Pixels in [-1, 1] -> latents (the family's ``encode``)."""
        return self.family.encode(self.vae, pixels_B_3_H_W.to(self.device), sample_posterior, generator)

    def sampling_settings(self) -> dict[str, Any]:
        """``DenoiserPolicy.sampling_settings`` and the family's ``sampling_extras`` (a video family's frames)."""
        return {**super().sampling_settings(), **self.family.sampling_extras()}

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


class SD3Family(FlowFamily):
    """Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``; Esser et al. 2024): an ``SD3Transformer2DModel`` with
    CLIP-L and CLIP-G (``CLIPTextModelWithProjection``) and an optional T5 (None: zeros, as the stock pipeline).
    ``prompt_embeds`` [B, 77 + T5 tokens, joint_attention_dim] and ``pooled_prompt_embeds`` [B, P_L + P_G] (module
    docstring); the transformer takes the latents [B, C, H, W] in p x p patches and the timestep sigma x 1000;
    classifier-free guidance is one doubled batch [uncond; cond] and u + w (c - u)."""

    name, title, pipeline = "sd3", "SD3", "StableDiffusion3Pipeline"
    markers = ("stable-diffusion-3", "sd3")
    text_parts = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    optional_parts = ("text_encoder_3", "tokenizer_3")  # T5; left out: zeros, as the stock pipeline
    transformer_class = "SD3Transformer2DModel"
    lora_target_modules = SD3_LORA_TARGET_MODULES
    guidance_scale, max_sequence_length = 4.5, 256  # StableDiffusion3Pipeline's defaults
    t5_optional = True
    layout = ("StableDiffusion3Pipeline (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, "
              "text_encoder_2/, tokenizer_2/, scheduler/[, text_encoder_3/, tokenizer_3/])")

    def default_size(self, vae_scale_factor: int) -> int:
        """The transformer's ``sample_size`` (latent pixels) x the VAE factor."""
        return self.config.sample_size * vae_scale_factor

    def pixel_multiple(self, vae_scale_factor: int) -> int:
        return vae_scale_factor * self.config.patch_size

    def latent_shape(self, batch: int, height: int, width: int, vae_scale_factor: int) -> tuple[int, int, int, int]:
        """(B, in_channels, height / VAE factor, width / VAE factor)."""
        return (batch, self.config.in_channels, height // vae_scale_factor, width // vae_scale_factor)

    def image_tokens(self, height: int, width: int, vae_scale_factor: int) -> int:
        """(H / p) (W / p) patches of the latents (p: the transformer's ``patch_size``)."""
        patch = self.config.patch_size
        return (height // vae_scale_factor // patch) * (width // vae_scale_factor // patch)

    def set_timesteps(self, scheduler, num_steps: int, image_tokens: int) -> None:
        """``set_timesteps(N)`` with the stock pipeline's dynamic-shift ``mu`` = ``calculate_shift(image_tokens)``
        when the scheduler's config asks for it (``use_dynamic_shifting``)."""
        kwargs = {}
        config = scheduler.config
        if config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            kwargs["mu"] = calculate_shift(image_tokens, config.get("base_image_seq_len", 256),
                                           config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                           config.get("max_shift", 1.16))
        scheduler.set_timesteps(num_steps, **kwargs)

    def _clip(self, tokenizer, encoder, prompts: list[str], device: torch.device) -> tuple[Tensor, Tensor]:
        """(penultimate hidden states [B, 77, D], projected pooled output [B, P]) of one CLIP encoder; both
        tokenizers pad to the first one's ``model_max_length``, as the stock pipeline."""
        ids = tokenizer(list(prompts), padding="max_length", max_length=self.tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids.to(device)
        out = encoder(ids, output_hidden_states=True)
        return out.hidden_states[-2], out[0]

    def encode_prompts(self, prompts: list[str], device: torch.device, dtype: torch.dtype,
                       max_sequence_length: int) -> dict[str, Tensor]:
        """``StableDiffusion3Pipeline.encode_prompt`` (clip_skip None, one image per prompt):
        ``prompt_embeds`` [B, 77 + T5 tokens, joint_attention_dim] and ``pooled_prompt_embeds`` [B, P_L + P_G]."""
        h1, p1 = self._clip(self.tokenizer, self.text_encoder, prompts, device)
        h2, p2 = self._clip(self.tokenizer_2, self.text_encoder_2, prompts, device)
        clip = torch.cat([h1, h2], dim=-1)
        if self.text_encoder_3 is None:
            t5 = torch.zeros(len(prompts), max_sequence_length, self.config.joint_attention_dim, device=device,
                             dtype=clip.dtype)
        else:
            ids = self.tokenizer_3(list(prompts), padding="max_length", max_length=max_sequence_length,
                                   truncation=True, add_special_tokens=True, return_tensors="pt").input_ids
            t5 = self.text_encoder_3(ids.to(device))[0]
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        embeds = torch.cat([clip.to(t5.dtype), t5], dim=-2)
        return {"prompt_embeds": embeds.to(dtype), "pooled_prompt_embeds": torch.cat([p1, p2], dim=-1).to(dtype)}

    def velocity(self, policy: FlowPolicyBase, model, latents: Tensor, t_B: Tensor, cond: dict[str, Tensor],
                 cfg: bool) -> Tensor:
        """The (guided) velocity v [B, C, H, W] at (latents, t); with CFG (``cfg`` and guidance_scale > 1)
        one doubled batch [uncond; cond] and u + w (c - u) (``policy._guided``), as the stock pipeline."""
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        x = latents.to(policy.dtype)

        def call(hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                 pooled_projections: Tensor) -> Tensor:
            return model(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                         pooled_projections=pooled_projections, return_dict=False)[0]

        if not (cfg and policy._cfg):
            return call(x, t_B, embeds, pooled)
        b, uncond = x.shape[0], policy._uncond()
        doubled = dict(hidden_states=torch.cat([x, x]), timestep=torch.cat([t_B, t_B]),
                       encoder_hidden_states=torch.cat([uncond["prompt_embeds"].expand(b, -1, -1), embeds]),
                       pooled_projections=torch.cat([uncond["pooled_prompt_embeds"].expand(b, -1), pooled]))
        return policy._guided(call, doubled, b)

    @staticmethod
    def load_text_parts(path_or_hub_id: str, opts: dict[str, Any], model_kw: dict[str, Any],
                        load_t5: bool) -> dict[str, Any]:
        """CLIP-L and CLIP-G (``CLIPTextModelWithProjection``) with their tokenizers, and T5 (``T5EncoderModel``)
        with ``tokenizer_3`` when ``load_t5`` and the folder's ``model_index.json`` names a ``text_encoder_3``."""
        from diffusers import DiffusionPipeline
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        config = DiffusionPipeline.load_config(path_or_hub_id, **opts)
        clip = CLIPTextModelWithProjection
        parts = {
            "text_encoder": clip.from_pretrained(path_or_hub_id, subfolder="text_encoder", **model_kw),
            "tokenizer": CLIPTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer", **opts),
            "text_encoder_2": clip.from_pretrained(path_or_hub_id, subfolder="text_encoder_2", **model_kw),
            "tokenizer_2": CLIPTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_2", **opts),
        }
        if load_t5 and (config.get("text_encoder_3") or [None])[0] is not None:
            from transformers import AutoTokenizer, T5EncoderModel

            parts["text_encoder_3"] = T5EncoderModel.from_pretrained(path_or_hub_id, subfolder="text_encoder_3",
                                                                     **model_kw)
            parts["tokenizer_3"] = AutoTokenizer.from_pretrained(path_or_hub_id, subfolder="tokenizer_3", **opts)
        return parts


class FlowMatchingPolicy(FlowPolicyBase):
    """``FlowPolicyBase`` with ``family=SD3Family`` (Stable Diffusion 3 / 3.5), kept as a name: its text parts
    CLIP-L, CLIP-G and an optional T5, its defaults and its saving are ``SD3Family``'s."""

    family_class = SD3Family
