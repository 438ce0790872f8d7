"""The image families as data: ``FAMILIES`` maps each ``--model_family`` name to its adapter class
(``unialign.image.family.ImageFamily``), whose class attributes are the family's row. From it come the scripts'
``--model_family`` choices and help, the auto-detection of a folder or hub id (``resolve``), the policy a model
loads into (``ImageFamily.load``) and the sampler knobs it is given and checked for
(``unialign.recipes.image.policy_kwargs``, ``check_sampling_knobs``).

Adding a family is one adapter file (``unialign.image.zimage`` is one: a ``FlowFamily`` subclass), one entry
of ``ADAPTERS`` below, and its tests; nothing else names a family.
"""

from __future__ import annotations

import json
from pathlib import Path

from unialign.image.family import COMMON_KNOBS, ImageFamily, SamplerKnobs
from unialign.image.flow_policy import FlowFamily, SD3Family
from unialign.image.flux_policy import FluxFamily
from unialign.image.policy import SD1Family, SDXLFamily
from unialign.image.wan import WanFamily
from unialign.image.zimage import ZImageFamily

__all__ = ["ADAPTERS", "COMMON_KNOBS", "FAMILIES", "FAMILY_CHOICES", "Family", "ImageFamily", "KERNEL_WORDS",
           "PIPELINE_FAMILIES", "SamplerKnobs", "choose_flow_family", "family_names", "flow_families", "get_family",
           "resolve"]

Family = type[ImageFamily]  # a row of the table: the adapter class
ADAPTERS: tuple[Family, ...] = (SD1Family, SDXLFamily, SD3Family, FluxFamily, ZImageFamily, WanFamily)
FAMILIES: dict[str, Family] = {f.name: f for f in ADAPTERS}
FAMILY_CHOICES = ("auto", *FAMILIES)  # the --model_family choices
# the families in the --model_family help lines, by step kernel (a new row shows up in them by itself)
KERNEL_WORDS = {"ddim": "DDIM, DiffusionPolicy", "flow_sde": "flow matching with Flow-GRPO's SDE step"}
# diffusers pipeline class (model_index.json "_class_name") -> family
PIPELINE_FAMILIES = {f.pipeline: f for f in FAMILIES.values()}


def family_names(detail: bool = True) -> str:
    """``"sd | sdxl (DDIM, DiffusionPolicy) | sd3 | flux (flow matching ...)"``: the families in table order, each
    run of one step kernel followed by ``KERNEL_WORDS`` (``detail``), for the ``--model_family`` help."""
    rows, out = list(FAMILIES.values()), []
    for i, row in enumerate(rows):
        last_of_kind = i + 1 == len(rows) or rows[i + 1].kernel != row.kernel
        out.append(f"{row.name} ({KERNEL_WORDS[row.kernel]})" if detail and last_of_kind else row.name)
    return " | ".join(out)


def get_family(family: str | Family) -> Family:
    """The adapter of ``family`` (a name or an adapter); ValueError naming the field for an unknown name."""
    if isinstance(family, type) and issubclass(family, ImageFamily):
        return family
    if family not in FAMILIES:
        raise ValueError(f"model_family: {family!r} is not one of {', '.join(FAMILY_CHOICES)}")
    return FAMILIES[family]


def resolve(model_name_or_path: str, family: str | Family = "auto") -> Family:
    """The adapter of ``family``, or with "auto": of a local folder's ``model_index.json`` pipeline class, else of
    the hub id's name (the family with the longest ``markers`` entry in it; none: the family without markers)."""
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
    found = [(len(m), i, row) for i, row in enumerate(FAMILIES.values()) for m in row.markers if m in lowered]
    if found:
        return max(found, key=lambda hit: (hit[0], -hit[1]))[2]
    return next(f for f in reversed(FAMILIES.values()) if not f.markers)


def flow_families() -> tuple[type[FlowFamily], ...]:
    """The flow-matching adapters of ``FAMILIES``, in table order."""
    return tuple(f for f in FAMILIES.values() if issubclass(f, FlowFamily))


def choose_flow_family(transformer) -> type[FlowFamily]:
    """The adapter of the flow family whose ``transformer_class`` ``transformer`` is (``FlowFamily.describes``);
    ValueError naming the transformer's class and the classes the families run."""
    for family in flow_families():
        if family.describes(transformer):
            return family
    runs = ", ".join(f"{f.transformer_class} ({f.title})" for f in flow_families())
    raise ValueError(f"no flow-matching family runs {type(transformer).__name__}; the families run {runs}")
