"""Diffusion side of unialign: ``DenoiserPolicy`` (the part every denoiser shares), the DDIM step with
log-probability and ``DiffusionPolicy`` (SD1.x / SDXL as the family adapters ``SD1Family`` / ``SDXLFamily`` of
one ``UNetFamily`` interface), the flow-matching policies ``FlowMatchingPolicy`` (SD3 family) and
``FluxPolicy`` (FLUX.1) on ``FlowPolicyBase``.

Importing this package imports torch only; diffusers / transformers / peft are imported when a
policy is built (``import unialign`` never imports this package).
"""

from unialign.image.ddim import ddim_step_coefficients, ddim_step_with_logprob, gaussian_logprob_mean
from unialign.image.denoiser import DenoiserPolicy
from unialign.image.flow_policy import FlowMatchingPolicy, FlowPolicyBase
from unialign.image.flux_policy import FluxPolicy
from unialign.image.policy import DiffusionPolicy, SD1Family, SDXLFamily, UNetFamily

__all__ = ["DenoiserPolicy", "DiffusionPolicy", "FlowMatchingPolicy", "FlowPolicyBase", "FluxPolicy", "SD1Family", "SDXLFamily",
           "UNetFamily", "ddim_step_coefficients", "ddim_step_with_logprob", "gaussian_logprob_mean"]
