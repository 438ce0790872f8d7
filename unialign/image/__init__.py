"""Diffusion side of unialign: ``DenoiserPolicy`` (the part every denoiser shares), the DDIM step with
log-probability, ``DiffusionPolicy`` (the DDIM step on SD1.x / SDXL UNets) and ``FlowPolicyBase`` (Flow-GRPO's
SDE step on flow-matching transformers). A family is one adapter class (``ImageFamily``: ``SD1Family`` /
``SDXLFamily`` of ``UNetFamily``; ``SD3Family`` / ``FluxFamily`` / ``ZImageFamily`` / ``WanFamily`` (text-to-video) of ``FlowFamily``), the
family table ``unialign.image.families.FAMILIES`` is those classes by name; ``FlowMatchingPolicy`` and
``FluxPolicy`` are ``FlowPolicyBase`` with SD3's / FLUX.1's adapter, kept as names.

Importing this package imports torch only; diffusers / transformers / peft are imported when a
policy is built (``import unialign`` never imports this package).
"""

from unialign.image.ddim import ddim_step_coefficients, ddim_step_with_logprob, gaussian_logprob_mean
from unialign.image.denoiser import DenoiserPolicy
from unialign.image.family import ImageFamily, SamplerKnobs
from unialign.image.flow_policy import FlowFamily, FlowMatchingPolicy, FlowPolicyBase, SD3Family
from unialign.image.flux_policy import FluxFamily, FluxPolicy
from unialign.image.policy import DiffusionPolicy, SD1Family, SDXLFamily, UNetFamily
from unialign.image.wan import WanFamily
from unialign.image.zimage import ZImageFamily

__all__ = ["DenoiserPolicy", "DiffusionPolicy", "FlowFamily", "FlowMatchingPolicy", "FlowPolicyBase", "FluxFamily",
           "FluxPolicy", "ImageFamily", "SD1Family", "SD3Family", "SDXLFamily", "SamplerKnobs", "UNetFamily",
           "WanFamily", "ZImageFamily", "ddim_step_coefficients", "ddim_step_with_logprob", "gaussian_logprob_mean"]
