"""Masked-diffusion language models (LLaDA, Dream, DiffuCoder, ModernBERT-architecture chat models) behind the
``Policy`` protocol: ``MaskedDiffusionLMPolicy`` (``policy``), block-decoding sampling (``sampling``) and the
families as data rows (``families``). The log-prob estimators are math: ``unialign.algos.masked_diffusion``."""

from unialign.dlm.families import FAMILIES, Family, family_of, is_masked_diffusion
from unialign.dlm.policy import MaskedDiffusionLMPolicy
from unialign.dlm.sampling import DiffusionSampling, block_decode

__all__ = ["FAMILIES", "DiffusionSampling", "Family", "MaskedDiffusionLMPolicy", "block_decode", "family_of",
           "is_masked_diffusion"]
