"""Masked-diffusion LM families as data rows: what differs between LLaDA, Dream, DiffuCoder and a native
ModernBERT-architecture chat model is a mask token, where the logits of a position are read (target alignment),
whether the checkpoint needs remote code, and the sampling defaults of its papers. A new family is a row.

Target alignment, the pitfall of swapping one model for another:

    "aligned"  position i's logits predict token i (LLaDA, ModernBERT masked LMs, the embedded model);
    "shifted"  position i's logits predict token i + 1, as in the causal LM the model was adapted from (Dream and
               DiffuCoder: ``logits[:, :-1]`` score ``tokens[:, 1:]``).

A uniform-noise discrete diffusion model (transformers' DiffusionGemma) corrupts tokens into other tokens, not
into a mask: none of the absorbing-state estimators applies, so it is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ALIGNMENTS = ("aligned", "shifted")


@dataclass(frozen=True)
class Family:
    """One family of masked-diffusion LMs."""

    name: str
    model_types: tuple[str, ...]       # ``config.model_type`` values that are this family
    alignment: str                     # "aligned" or "shifted" (module docstring)
    mask_token: str | None = None      # the tokenizer's mask token when it does not name one itself
    remote_code: bool = False          # its modelling code lives on the Hub (``--trust_remote_code``)
    sampling: dict[str, Any] = field(default_factory=dict)  # the papers' defaults (``DiffusionSampling`` fields)
    cite: str = ""
    inputs: tuple[str, ...] = ("attention_mask", "position_ids")  # what its forward takes beside input_ids

    def __post_init__(self) -> None:
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"family {self.name}: alignment must be one of {ALIGNMENTS}")


FAMILIES: dict[str, Family] = {f.name: f for f in (
    # LLaDA-8B (Nie et al. 2025, arXiv 2502.09992; GSAI-ML/LLaDA-8B-Instruct): mask id 126336, position-aligned;
    # d1's GSM8K sampling: 256 tokens, blocks of 32, 128 steps, low-confidence remasking, greedy.
    # Its remote modelling code takes no attention mask: prompts of one batch must be padded alike (d1's note).
    Family("llada", ("llada", "llada_moe"), "aligned", "<|mdm_mask|>", remote_code=True,
           sampling=dict(gen_length=256, block_length=32, steps=128, remasking="low_confidence"),
           cite="Nie et al. 2025; d1 (dllm-reasoning/d1)", inputs=()),
    # Dream-7B (Ye et al. 2025, Dream-org/Dream-v0-Instruct-7B) and DiffuCoder (apple/DiffuCoder-7B-Instruct):
    # adapted from Qwen2.5, so shifted; sampled in one block (block length = generation length), 256 tokens.
    Family("dream", ("Dream", "dream"), "shifted", "<|mask|>", remote_code=True,
           sampling=dict(gen_length=256, block_length=256, steps=128, remasking="low_confidence", temperature=1.0),
           cite="Ye et al. 2025; DiffuCoder (apple/ml-diffucoder)"),
    # ModernBERT-architecture diffusion chat models (e.g. dllm-collection's ModernBERT-large-chat): native in
    # transformers (AutoModelForMaskedLM), aligned, the tokenizer's own [MASK].
    Family("modernbert", ("modernbert",), "aligned",
           sampling=dict(gen_length=256, block_length=32, steps=128, remasking="low_confidence"),
           cite="Warner et al. 2024 (ModernBERT); ZHZisZZ/dllm"),
)}

UNIFORM_NOISE_MODEL_TYPES = ("diffusion_gemma", "diffusiongemma")


def require_trust(family: Family, name_or_path: str, trust_remote_code: bool) -> None:
    """A ValueError (one line, naming the flag) for a remote-code family without ``trust_remote_code``."""
    if family.remote_code and not trust_remote_code:
        raise ValueError(f"{name_or_path} is a {family.name} model, whose modelling code is on the Hub, not in "
                         "transformers: pass --trust_remote_code to run it (read that code first)")


def family_of(config: Any, name_or_path: str) -> Family:
    """The family of a loaded ``config`` (``model_type``; a ``unialign_family`` entry in config.json wins), or a
    ValueError naming the model: a uniform-noise model is refused, an unknown type lists the known ones."""
    explicit = getattr(config, "unialign_family", None)
    if explicit is not None:
        if explicit not in FAMILIES:
            raise ValueError(f"{name_or_path}: config.json names unialign_family {explicit!r}; known: {sorted(FAMILIES)}")
        return FAMILIES[explicit]
    model_type = getattr(config, "model_type", None)
    if model_type in UNIFORM_NOISE_MODEL_TYPES:
        raise ValueError(f"{name_or_path} is a uniform-noise discrete diffusion model ({model_type}): it corrupts "
                         "tokens into other tokens, not into a mask, so the absorbing-state (masked-diffusion) "
                         "log-prob estimators do not apply; unialign trains masked-diffusion LMs")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    raise ValueError(f"{name_or_path}: model_type {model_type!r} is not a known masked-diffusion LM family "
                     f"({', '.join(t for f in FAMILIES.values() for t in f.model_types)}); add a row to "
                     "unialign.dlm.families.FAMILIES")


def is_masked_diffusion(config: Any) -> bool:
    """Whether a loaded config is a masked-diffusion LM (a known family, or named by ``unialign_family``), or a
    uniform-noise one (refused by ``family_of`` with its reason)."""
    if getattr(config, "unialign_family", None) is not None:
        return True
    model_type = getattr(config, "model_type", None)
    return model_type in UNIFORM_NOISE_MODEL_TYPES or any(model_type in f.model_types for f in FAMILIES.values())
