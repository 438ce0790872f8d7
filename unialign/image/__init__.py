"""Diffusion side of unialign: ``DenoiserPolicy`` (the part every denoiser shares), the DDIM step with
log-probability and ``DiffusionPolicy`` (SD1.x / SDXL as the family adapters ``SD1Family`` / ``SDXLFamily`` of
one ``UNetFamily`` interface), and the flow-matching policy ``FlowPolicyBase`` (SD3 / FLUX.1 as the family
adapters ``SD3Family`` / ``FluxFamily`` of one ``FlowFamily`` interface; ``FlowMatchingPolicy`` and
``FluxPolicy`` are it pinned to each).

Importing this package imports torch only; diffusers / transformers / peft are imported when a
policy is built (``import unialign`` never imports this package).
"""

from unialign.image.ddim import ddim_step_coefficients, ddim_step_with_logprob, gaussian_logprob_mean
from unialign.image.denoiser import DenoiserPolicy
from unialign.image.flow_policy import FlowFamily, FlowMatchingPolicy, FlowPolicyBase, SD3Family
from unialign.image.flux_policy import FluxFamily, FluxPolicy
from unialign.image.policy import DiffusionPolicy, SD1Family, SDXLFamily, UNetFamily

__all__ = ["DenoiserPolicy", "DiffusionPolicy", "FlowFamily", "FlowMatchingPolicy", "FlowPolicyBase", "FluxFamily",
           "FluxPolicy", "SD1Family", "SD3Family", "SDXLFamily", "UNetFamily", "ddim_step_coefficients",
           "ddim_step_with_logprob", "gaussian_logprob_mean"]
