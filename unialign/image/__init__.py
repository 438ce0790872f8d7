"""Diffusion side of unialign: the DDIM step with log-probability and ``DiffusionPolicy`` (SD1.x / SDXL).

Importing this package imports torch only; diffusers / transformers / peft are imported when a
``DiffusionPolicy`` is built (``import unialign`` never imports this package).
"""

from unialign.image.ddim import ddim_step_coefficients, ddim_step_with_logprob, gaussian_logprob_mean
from unialign.image.flow_policy import FlowMatchingPolicy
from unialign.image.policy import DiffusionPolicy

__all__ = ["DiffusionPolicy", "FlowMatchingPolicy", "ddim_step_coefficients", "ddim_step_with_logprob", "gaussian_logprob_mean"]
