"""What every image family adapter is, and the sampler knobs as one value. Light: imports no torch or diffusers.

A family is one adapter class (``ImageFamily``): its class attributes are the family's row in
``unialign.image.families.FAMILIES`` (the ``--model_family`` name, how messages name it, the diffusers pipeline
class a folder's ``model_index.json`` names, the hub-id markers, the step kernel by name, the sampler knobs its
policy takes), and an instance holds the family's text parts by their diffusers component names. The two kinds
of adapter: ``unialign.image.policy.UNetFamily`` (SD1.x, SDXL: ``DiffusionPolicy``) and
``unialign.image.flow_policy.FlowFamily`` (SD3, FLUX.1, Z-Image: ``FlowPolicyBase``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields, replace
from typing import Any

# the sampler knobs (SamplerKnobs' fields) every policy takes; a family adds its step kernel's
# (``unialign.image.kernels``: ``DDIMKernel.knobs``, ``FlowSDEKernel.knobs``) and its text encoder's
COMMON_KNOBS = ("num_steps", "guidance_scale", "height", "width")


@dataclass(frozen=True)
class SamplerKnobs:
    """A policy's sampler knobs as one frozen value (the ``knobs=`` argument of ``DiffusionPolicy`` and
    ``FlowPolicyBase``; ``unialign.recipes.image.sampler_knobs`` builds it from a config). A field left None
    leaves the constructor's keyword of that name (its default, or what a loader passed); a policy reads only the
    fields that apply to its family (``ImageFamily.knobs``). The meaning of each field: the policies' keywords of
    the same name."""

    num_steps: int | None = None
    guidance_scale: float | None = None
    height: int | None = None
    width: int | None = None
    eta: float | None = None
    timestep_fraction: float | None = None
    min_step_std: float | None = None
    noise_level: float | None = None
    sde_type: str | None = None
    sde_window_size: int | None = None
    sde_window_range: tuple[int, int] | None = None
    max_sequence_length: int | None = None
    num_frames: int | None = None

    @classmethod
    def over(cls, knobs: SamplerKnobs | None, **keywords: Any) -> SamplerKnobs:
        """A value of ``keywords`` (a constructor's knobs), each replaced by the field of ``knobs`` of that name
        when it is set."""
        if knobs is not None:
            keywords = {k: v if getattr(knobs, k) is None else getattr(knobs, k) for k, v in keywords.items()}
        return cls(**keywords)

    def for_family(self, family: type[ImageFamily]) -> SamplerKnobs:
        """This value with only the fields that apply to ``family`` (the others None)."""
        keep = (*COMMON_KNOBS, *family.knobs)
        return replace(self, **{f.name: None for f in fields(self) if f.name not in keep})


class ImageFamily:
    """One image pipeline family: the class attributes describe it (they are its ``FAMILIES`` row), an instance
    holds its text parts (``parts``) for its policy.

    Class attributes:
        name: the ``--model_family`` value.  title: how messages name it ("SDXL").
        pipeline: the diffusers pipeline class, by name (a folder's ``model_index.json`` ``_class_name``;
            ``pipeline_class`` imports it).
        policy: the policy class that runs the family, as "module:Class" (``policy_class`` imports it).
        kernel: the step kernel its policy samples and scores with, by name (``unialign.image.kernels.KERNELS``).
        markers: lower-case substrings of a hub id that name the family with ``--model_family auto`` (the longest
            matching marker wins; no markers: the fallback of an id that matches none).
        knobs: the ``SamplerKnobs`` fields beyond ``COMMON_KNOBS`` that its policy takes.
        replacement_vae: whether ``from_pretrained`` takes ``vae_name_or_path``.
        text_parts: the text encoders and tokenizers it needs, by diffusers component name.
        optional_parts: those it may go without (all given or all left out).
        output_kind: what one sample is ("image" / "video": the rewards that score it,
            ``unialign.rewards.registry.REWARD_INPUTS``) and the stock pipeline output's field holding them.
    """

    name: str = ""
    title: str = ""
    pipeline: str = ""
    policy: str = ""
    kernel: str = ""
    markers: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()
    replacement_vae: bool = False
    text_parts: tuple[str, ...] = ()
    optional_parts: tuple[str, ...] = ()
    output_kind: tuple[str, str] = ("image", "images")

    def __init__(self, **parts: Any) -> None:
        """Hold the text parts by name (each also an attribute); a part left None counts as not given. ValueError
        naming the part for one the family does not take, one it needs and lacks, or an optional set half given."""
        given = {k: v for k, v in parts.items() if v is not None}
        takes = (*self.text_parts, *self.optional_parts)
        for name in given:
            if name not in takes:
                raise ValueError(f"{self.title} takes the text parts {', '.join(takes)}; {name} is not one of them")
        for name in self.text_parts:
            if name not in given:
                raise ValueError(f"{self.title} needs {name} (its text parts: {', '.join(self.text_parts)})")
        optional = [name for name in self.optional_parts if name in given]
        if optional and len(optional) != len(self.optional_parts):
            raise ValueError(f"{' and '.join(self.optional_parts)} go together (all left out: {self.title} without "
                             "them)")
        self.parts = {name: given.get(name) for name in takes}
        for name, value in self.parts.items():
            setattr(self, name, value)

    @property
    def text_encoders(self) -> tuple:
        """The text encoders it holds (frozen by the policy), in ``text_parts`` order."""
        return tuple(v for k, v in self.parts.items() if k.startswith("text_encoder") and v is not None)

    @classmethod
    def policy_class(cls) -> type:
        """The policy class (imported now)."""
        module, _, name = cls.policy.partition(":")
        return getattr(importlib.import_module(module), name)

    @classmethod
    def pipeline_class(cls) -> type:
        """The stock diffusers pipeline class (``save_lora_weights``, a full fine-tune's folder)."""
        return getattr(importlib.import_module("diffusers"), cls.pipeline)

    @classmethod
    def load(cls, path_or_hub_id: str, guessed: bool = False, **kwargs: Any):
        """Its policy on a pipeline folder or hub id: ``policy_class().from_pretrained(path, family=cls, ...)``.
        ``guessed``: the family was read from the folder or the hub id's name, not named by the user
        (``families.resolve`` with "auto"); an adapter whose policy reads its family from the folder itself then
        leaves the choice to it (``UNetFamily``: SD1.x or SDXL from ``model_index.json``)."""
        return cls.policy_class().from_pretrained(path_or_hub_id, family=cls, **kwargs)
