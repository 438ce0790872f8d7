"""The family table (``unialign.image.families``): its rows are the adapter classes, and everything that chooses by
family reads them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from unialign.image.families import COMMON_KNOBS, FAMILIES, FAMILY_CHOICES, PIPELINE_FAMILIES, resolve
from unialign.image.kernels import KERNELS


def test_choices_detection_and_policies_come_from_the_table(tmp_path):
    from unialign.config import field_rules
    from unialign.recipes.image import ImageRLConfig, family_of

    field = next(f for f in dataclasses.fields(ImageRLConfig) if f.name == "model_family")
    assert tuple(field_rules(ImageRLConfig, field)["choices"]) == FAMILY_CHOICES == ("auto", *FAMILIES)
    for row in FAMILIES.values():
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": row.pipeline}))
        assert resolve(str(tmp_path)) is row and family_of(str(tmp_path)) == row.name
        assert PIPELINE_FAMILIES[row.pipeline] is row and row.pipeline_class().__name__ == row.pipeline
        assert hasattr(row.policy_class(), "from_pretrained") and row.kernel in KERNELS
        for marker in row.markers:
            assert resolve(f"org/model-{marker}-base") is row
    assert resolve("org/stable-diffusion-3-xl").name == "sd3"  # the longest marker wins ("xl" is SDXL's)
    assert resolve("Tongyi-MAI/Z-Image-Turbo").name == "zimage"
    assert resolve("org/anything").name == "sd"  # the family without markers


def test_the_knobs_follow_the_row():
    from unialign.recipes.image import ImageRLConfig, policy_kwargs

    cfg = ImageRLConfig()
    for row in FAMILIES.values():
        kw = policy_kwargs(cfg, row)
        assert kw == policy_kwargs(cfg, row.name)
        knobs = kw["knobs"]
        set_ = {f.name for f in dataclasses.fields(knobs) if getattr(knobs, f.name) is not None}
        assert set_ == {*COMMON_KNOBS, *row.knobs} - {"height", "width", "max_sequence_length", "sde_window_range",
                                                         "num_frames"}  # the unset optional ones
        assert set(row.knobs) >= set(KERNELS[row.kernel].knobs)  # the step kernel's knobs, named by the row
        assert (knobs.noise_level is not None) == (row.kernel == "flow_sde") == (knobs.eta is None)
        with pytest.raises(dataclasses.FrozenInstanceError):
            knobs.num_steps = 3
    with pytest.raises(ValueError, match="model_family"):
        policy_kwargs(cfg, "kandinsky")


def test_load_denoiser_dispatches_on_the_row(tmp_path, monkeypatch):
    from unialign.recipes import image as recipe

    seen = []

    class Fake:
        @classmethod
        def from_pretrained(cls, path, **kw):
            seen.append(kw)
            return "policy"

    for row in FAMILIES.values():
        monkeypatch.setattr(row, "policy", f"{__name__}:Fake")
        monkeypatch.setitem(globals(), "Fake", Fake)
        assert recipe.load_denoiser("x", row.name, num_steps=3) == "policy"
        assert seen.pop() == {"torch_dtype": None, "family": row, "num_steps": 3}
    assert recipe.load_denoiser("x") == "policy" and seen.pop() == {"torch_dtype": None}  # auto: no sdxl=


def test_knobs_replace_the_keywords_they_set():
    from unialign.image.families import SamplerKnobs

    k = SamplerKnobs.over(SamplerKnobs(num_steps=4, height=None), num_steps=10, guidance_scale=4.5, height=64)
    assert (k.num_steps, k.guidance_scale, k.height) == (4, 4.5, 64)
    assert SamplerKnobs.over(None, num_steps=10) == SamplerKnobs(num_steps=10)


def _sampled(policy) -> torch.Tensor:
    return policy.sample(["a cat", "cat"], generator=torch.Generator().manual_seed(5)).payload["latents"]


def test_knobs_give_the_policy_the_keywords_do(make_policy, tokenizer_dir):
    from tests.image.test_flow_policy import sd3_components
    from unialign.image.families import SamplerKnobs
    from unialign.image.flow_policy import FlowMatchingPolicy

    ddim = dict(num_steps=3, guidance_scale=2.0, eta=0.8, timestep_fraction=0.5, min_step_std=0.01)
    by_keywords, by_knobs = make_policy(**ddim), make_policy(knobs=SamplerKnobs(**ddim))
    assert by_knobs.knobs == by_keywords.knobs and by_knobs.num_steps == 3
    assert torch.equal(_sampled(by_keywords), _sampled(by_knobs))
    flow = dict(num_steps=3, guidance_scale=2.0, noise_level=0.5, sde_window_size=2, max_sequence_length=4)
    by_keywords = FlowMatchingPolicy(**sd3_components(tokenizer_dir), **flow)
    by_knobs = FlowMatchingPolicy(**sd3_components(tokenizer_dir), num_steps=9, knobs=SamplerKnobs(**flow))
    assert by_knobs.knobs == by_keywords.knobs and by_knobs.num_steps == 3 and by_knobs.height == by_keywords.height
    assert torch.equal(_sampled(by_keywords), _sampled(by_knobs))


def test_the_model_family_help_lists_the_table(monkeypatch):
    from unialign.image import families

    assert families.family_names() == ("sd | sdxl (DDIM, DiffusionPolicy) | sd3 | flux | zimage | wan (flow matching with "
                                       "Flow-GRPO's SDE step)")

    class SanaFamily(families.ImageFamily):
        name, title, pipeline, kernel, markers = "sana", "SANA", "SanaPipeline", "flow_sde", ("sana",)

    monkeypatch.setattr(families, "FAMILIES", {**families.FAMILIES, "sana": SanaFamily})
    assert families.family_names(False) == "sd | sdxl | sd3 | flux | zimage | wan | sana"
    assert families.resolve("org/sana-1.6b") is SanaFamily
