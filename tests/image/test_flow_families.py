"""The flow families' adapters (``FlowFamily``: ``SD3Family``, ``FluxFamily``): chosen once from the transformer
(over the flow rows of the family table) or given, pinned by ``FlowMatchingPolicy`` / ``FluxPolicy``, which refuse
another family's transformer naming both; the family's defaults fill the keywords left None."""

from __future__ import annotations

import pytest
import torch

from tests.image.conftest import sd_components
from tests.image.test_flow_policy import sd3_components
from tests.image.test_flux_policy import FLUX_DEFAULTS, flux_components
from unialign.image.families import FAMILIES
from unialign.image.flow_policy import (
    FlowMatchingPolicy,
    FlowPolicyBase,
    SD3Family,
    choose_flow_family,
    flow_families,
)
from unialign.image.flux_policy import FluxFamily, FluxPolicy

SD3_OPTS = dict(num_steps=2, guidance_scale=3.0, max_sequence_length=4)


def test_the_adapters_come_from_the_table_and_the_transformer_chooses(tokenizer_dir):
    families = flow_families()
    assert list(families) == [SD3Family, FluxFamily]
    assert [row.name for row in families.values()] == [r.name for r in FAMILIES.values() if r.flow] == ["sd3", "flux"]
    assert all(f.name == row.name and row.policy_class().family_class is f for f, row in families.items())
    assert choose_flow_family(sd3_components(tokenizer_dir)["transformer"]) is SD3Family
    assert choose_flow_family(flux_components(tokenizer_dir)["transformer"]) is FluxFamily
    with pytest.raises(ValueError, match=r"UNet2DConditionModel.*SD3Transformer2DModel \(SD3: .*FlowMatchingPolicy\)"
                                         r".*FluxTransformer2DModel \(FLUX.1: .*FluxPolicy\)"):
        choose_flow_family(sd_components(tokenizer_dir)["unet"])


def test_the_pinned_policies_hold_their_adapter(tokenizer_dir):
    sd3 = FlowMatchingPolicy(**sd3_components(tokenizer_dir), **SD3_OPTS)
    flux = FluxPolicy(**flux_components(tokenizer_dir), **FLUX_DEFAULTS)
    assert type(sd3.family) is SD3Family and type(flux.family) is FluxFamily
    assert isinstance(sd3, FlowPolicyBase) and isinstance(flux, FlowPolicyBase) and not isinstance(flux, FlowMatchingPolicy)
    assert sd3.text_encoder is sd3.family.text_encoder and sd3.text_encoder_3 is None and sd3.tokenizer_3 is None
    assert flux.text_encoder_2 is flux.family.text_encoder_2 and flux.text_encoder_3 is None
    assert sd3.family.text_encoders == (sd3.text_encoder, sd3.text_encoder_2)
    assert sd3._pipeline_class().__name__ == "StableDiffusion3Pipeline" and flux._pipeline_class().__name__ == "FluxPipeline"
    with pytest.raises(AttributeError):
        sd3.text_encoder = None  # read-only: the adapter holds the text parts


def test_the_unpinned_base_chooses_from_the_transformer_and_samples_as_the_pinned_class(tokenizer_dir):
    def latents(policy):
        return policy.sample(["a cat", "cat"], generator=torch.Generator().manual_seed(3)).payload["latents"]

    for cls, parts, opts, adapter in ((FlowMatchingPolicy, sd3_components, SD3_OPTS, SD3Family),
                                      (FluxPolicy, flux_components, FLUX_DEFAULTS, FluxFamily)):
        chosen = FlowPolicyBase(**parts(tokenizer_dir), **opts)
        given = FlowPolicyBase(**parts(tokenizer_dir), **opts, family=adapter)
        pinned = cls(**parts(tokenizer_dir), **opts)
        assert type(chosen.family) is type(given.family) is adapter
        assert torch.equal(latents(chosen), latents(pinned)) and torch.equal(latents(given), latents(pinned))


def test_a_pinned_policy_refuses_another_familys_transformer(tokenizer_dir):
    with pytest.raises(ValueError, match=r"FluxPolicy runs the FLUX.1 family \(FluxTransformer2DModel\), not "
                                         r"SD3Transformer2DModel \(the SD3 family's transformer\): build "
                                         r"unialign.image.flow_policy:FlowMatchingPolicy for it"):
        FluxPolicy(**sd3_components(tokenizer_dir), **SD3_OPTS)
    with pytest.raises(ValueError, match=r"FlowMatchingPolicy runs the SD3 family .*not FluxTransformer2DModel.*"
                                         r"FluxPolicy"):
        FlowMatchingPolicy(**flux_components(tokenizer_dir), **FLUX_DEFAULTS)
    with pytest.raises(ValueError, match="FluxPolicy runs the FLUX.1 family"):
        FluxPolicy(**flux_components(tokenizer_dir), **FLUX_DEFAULTS, family=SD3Family)
    with pytest.raises(ValueError, match="text_encoder_3 / tokenizer_3 are SD3's"):
        parts = flux_components(tokenizer_dir)
        FluxPolicy(**parts, text_encoder_3=parts["text_encoder"], tokenizer_3=parts["tokenizer"], **FLUX_DEFAULTS)
    with pytest.raises(ValueError, match="text_encoder_3 and tokenizer_3 go together"):
        FlowMatchingPolicy(**sd3_components(tokenizer_dir), tokenizer_3=object(), **SD3_OPTS)


def test_unset_keywords_take_the_familys_defaults(tokenizer_dir):
    from unialign.image.families import SamplerKnobs

    sd3 = FlowMatchingPolicy(**sd3_components(tokenizer_dir), num_steps=2)
    assert (sd3.guidance_scale, sd3.max_sequence_length, sd3.height, sd3.width) == (4.5, 256, 16, 16)  # 8 x VAE 2
    assert (sd3.knobs.guidance_scale, sd3.knobs.max_sequence_length, sd3.knobs.height) == (4.5, 256, 16)
    flux = FluxPolicy(**flux_components(tokenizer_dir), knobs=SamplerKnobs(num_steps=2))
    assert (flux.guidance_scale, flux.max_sequence_length, flux.height, flux.width) == (3.5, 512, 256, 256)  # 128 x 2
    set_ = FluxPolicy(**flux_components(tokenizer_dir), guidance_scale=1.0, max_sequence_length=6, height=16, width=8)
    assert (set_.guidance_scale, set_.max_sequence_length, set_.height, set_.width) == (1.0, 6, 16, 8)


def test_from_pretrained_is_the_pinned_familys(tmp_path):
    with pytest.raises(TypeError, match=r"FlowPolicyBase.from_pretrained.*FlowMatchingPolicy.*FluxPolicy"):
        FlowPolicyBase.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="load_t5=False: FLUX.1 cannot leave T5 out"):
        FluxPolicy.from_pretrained(str(tmp_path), load_t5=False)
