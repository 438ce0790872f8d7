"""The image families as data: one row per pipeline family, from which the scripts' ``--model_family`` choices,
the auto-detection of a folder or hub id (``resolve``), the policy a model loads into (``load_denoiser``) and the
sampler knobs it is given and checked for (``policy_kwargs``, ``check_sampling_knobs``) are derived.

Adding a family is one adapter file (a flow family: its ``FlowFamily`` adapter and the policy class pinned to
it, ``FlowPolicyBase`` with ``family_class`` set, as ``unialign.image.flux_policy``), one row of ``FAMILIES`` naming
that policy, and its tests; nothing else tests a family's name (the flow policies find their adapters through the
rows: ``unialign.image.flow_policy.flow_families``). Light: imports no torch or diffusers (the policy class is imported when a
model loads).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

# the sampler knobs (SamplerKnobs' fields) every policy takes, and those of each kind of step kernel
# (unialign.image.kernels): DDIM's and the flow-matching SDE's (with the T5 prompt length of the flow families)
COMMON_KNOBS = ("num_steps", "guidance_scale", "height", "width")
DDIM_KNOBS = ("eta", "timestep_fraction", "min_step_std")
FLOW_KNOBS = ("noise_level", "sde_type", "sde_window_size", "sde_window_range", "max_sequence_length")


@dataclass(frozen=True)
class SamplerKnobs:
    """A policy's sampler knobs as one frozen value (the ``knobs=`` argument of ``DiffusionPolicy``,
    ``FlowMatchingPolicy`` and ``FluxPolicy``; ``unialign.recipes.image.sampler_knobs`` builds it from a config).
    A field left None leaves the constructor's keyword of that name (its default, or what a loader passed); a
    policy reads only the fields that apply to it (``Family.knobs``). The meaning of each field: the policies'
    keywords of the same name."""

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

    @classmethod
    def over(cls, knobs: SamplerKnobs | None, **keywords: Any) -> SamplerKnobs:
        """A value of ``keywords`` (a constructor's knobs), each replaced by the field of ``knobs`` of that name
        when it is set."""
        if knobs is not None:
            keywords = {k: v if getattr(knobs, k) is None else getattr(knobs, k) for k, v in keywords.items()}
        return cls(**keywords)

    def for_family(self, family: Family) -> SamplerKnobs:
        """This value with only the fields that apply to ``family`` (the others None)."""
        keep = (*COMMON_KNOBS, *family.knobs)
        return replace(self, **{f.name: None for f in fields(self) if f.name not in keep})


@dataclass(frozen=True)
class Family:
    """One image pipeline family.

    Args:
        name: the ``--model_family`` value.  title: how messages name it ("SDXL").
        pipeline_class: the diffusers pipeline class a folder's ``model_index.json`` names (``_class_name``).
        policy: the policy class, as "module:Class" (imported by ``policy_class``).
        flow: flow matching (``FlowSDEKernel``, Euler as the deterministic solver) rather than DDIM.
        markers: lower-case substrings of a hub id that name the family with ``--model_family auto``
            (checked in ``detection_order``); no markers: the fallback of an id that matches none.
        knobs: the ``SamplerKnobs`` fields beyond the common ones that its policy takes.
        load_kwargs: what ``from_pretrained`` is told when the family is named rather than detected.
        replacement_vae: whether ``from_pretrained`` takes ``vae_name_or_path``.
    """

    name: str
    title: str
    pipeline_class: str
    policy: str
    flow: bool
    markers: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()
    load_kwargs: tuple[tuple[str, Any], ...] = ()
    replacement_vae: bool = False

    def policy_class(self) -> type:
        """The policy class (imported now)."""
        module, _, cls = self.policy.partition(":")
        return getattr(importlib.import_module(module), cls)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("sd", "SD1.x", "StableDiffusionPipeline", "unialign.image.policy:DiffusionPolicy", flow=False,
           knobs=DDIM_KNOBS, load_kwargs=(("sdxl", False),), replacement_vae=True),
    Family("sdxl", "SDXL", "StableDiffusionXLPipeline", "unialign.image.policy:DiffusionPolicy", flow=False,
           markers=("xl",), knobs=DDIM_KNOBS, load_kwargs=(("sdxl", True),), replacement_vae=True),
    Family("sd3", "SD3", "StableDiffusion3Pipeline", "unialign.image.flow_policy:FlowMatchingPolicy", flow=True,
           markers=("stable-diffusion-3", "sd3"), knobs=FLOW_KNOBS),
    Family("flux", "FLUX.1", "FluxPipeline", "unialign.image.flux_policy:FluxPolicy", flow=True,
           markers=("flux",), knobs=FLOW_KNOBS),
)}
FAMILY_CHOICES = ("auto", *FAMILIES)  # the --model_family choices
# the families in the --model_family help lines, by kind of step kernel (a new row shows up in them by itself)
KERNEL_WORDS = {False: "DDIM, DiffusionPolicy", True: "flow matching with Flow-GRPO's SDE step"}


def family_names(detail: bool = True) -> str:
    """``"sd | sdxl (DDIM, DiffusionPolicy) | sd3 | flux (flow matching ...)"``: the families in table order, each
    run of one kind of kernel followed by ``KERNEL_WORDS`` (``detail``), for the ``--model_family`` help."""
    rows, out = list(FAMILIES.values()), []
    for i, row in enumerate(rows):
        last_of_kind = i + 1 == len(rows) or rows[i + 1].flow != row.flow
        out.append(f"{row.name} ({KERNEL_WORDS[row.flow]})" if detail and last_of_kind else row.name)
    return " | ".join(out)
# diffusers pipeline class (model_index.json "_class_name") -> family
PIPELINE_FAMILIES = {f.pipeline_class: f for f in FAMILIES.values()}


def detection_order() -> list[Family]:
    """The families whose hub-id markers ``resolve`` checks, in order: flow families first (their markers are
    the more specific ones), then the others; the last family without markers is the fallback."""
    return sorted((f for f in FAMILIES.values() if f.markers), key=lambda f: not f.flow)


def get_family(family: str | Family) -> Family:
    """The ``FAMILIES`` row of ``family`` (a name or a row); ValueError naming the field for an unknown name."""
    if isinstance(family, Family):
        return family
    if family not in FAMILIES:
        raise ValueError(f"model_family: {family!r} is not one of {', '.join(FAMILY_CHOICES)}")
    return FAMILIES[family]


def resolve(model_name_or_path: str, family: str | Family = "auto") -> Family:
    """The row of ``family``, or with "auto": of a local folder's ``model_index.json`` pipeline class, else of the
    hub id's name (a family's ``markers``, in ``detection_order``; none matching: the family without markers)."""
    if family != "auto":
        return get_family(family)
    index = Path(model_name_or_path) / "model_index.json"
    if index.is_file():
        name = json.loads(index.read_text()).get("_class_name", "")
        if name not in PIPELINE_FAMILIES:
            raise ValueError(f"model_name_or_path: {model_name_or_path!r} holds a {name!r}; this script trains "
                             f"{', '.join(PIPELINE_FAMILIES)} (or set --model_family)")
        return PIPELINE_FAMILIES[name]
    lowered = model_name_or_path.lower()
    for row in detection_order():
        if any(marker in lowered for marker in row.markers):
            return row
    return next(f for f in reversed(FAMILIES.values()) if not f.markers)
