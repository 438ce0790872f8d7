"""The flow families' adapters (``FlowFamily``: ``SD3Family``, ``FluxFamily``, ``ZImageFamily``): given to
``FlowPolicyBase(family=...)`` (found from a transformer by ``families.choose_flow_family``), held by the names
``FlowMatchingPolicy`` / ``FluxPolicy``; a transformer or text part that is not the family's is refused by name;
the family's defaults fill the keywords left None."""

from __future__ import annotations

import pytest
import torch

from tests.image.conftest import sd_components
from tests.image.test_flow_policy import sd3_components
from tests.image.test_flux_policy import FLUX_DEFAULTS, flux_components
from unialign.image.families import FAMILIES, choose_flow_family, flow_families
from unialign.image.flow_policy import FlowMatchingPolicy, FlowPolicyBase, SD3Family
from unialign.image.flux_policy import FluxFamily, FluxPolicy
from unialign.image.wan import WanFamily
from unialign.image.zimage import ZImageFamily

SD3_OPTS = dict(num_steps=2, guidance_scale=3.0, max_sequence_length=4)


def test_the_adapters_come_from_the_table_and_the_transformer_chooses(tokenizer_dir):
    families = flow_families()
    assert families == (SD3Family, FluxFamily, ZImageFamily, WanFamily)
    assert [f.name for f in families] == [r.name for r in FAMILIES.values() if r.kernel == "flow_sde"]
    assert all(FAMILIES[f.name] is f and f.policy_class() is FlowPolicyBase for f in families)
    assert choose_flow_family(sd3_components(tokenizer_dir)["transformer"]) is SD3Family
    assert choose_flow_family(flux_components(tokenizer_dir)["transformer"]) is FluxFamily
    with pytest.raises(ValueError, match=r"UNet2DConditionModel.*SD3Transformer2DModel \(SD3\)"
                                         r".*FluxTransformer2DModel \(FLUX.1\).*ZImageTransformer2DModel \(Z-Image\)"
                                         r".*WanTransformer3DModel \(Wan 2.1\)"):
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


def test_the_base_with_the_family_given_samples_as_the_named_class(tokenizer_dir):
    def latents(policy):
        return policy.sample(["a cat", "cat"], generator=torch.Generator().manual_seed(3)).payload["latents"]

    for cls, parts, opts, adapter in ((FlowMatchingPolicy, sd3_components, SD3_OPTS, SD3Family),
                                      (FluxPolicy, flux_components, FLUX_DEFAULTS, FluxFamily)):
        components = parts(tokenizer_dir)
        chosen = FlowPolicyBase(**components, **opts, family=choose_flow_family(components["transformer"]))
        given = FlowPolicyBase(**parts(tokenizer_dir), **opts, family=adapter)
        named = cls(**parts(tokenizer_dir), **opts)
        assert type(chosen.family) is type(given.family) is type(named.family) is adapter
        assert torch.equal(latents(chosen), latents(named)) and torch.equal(latents(given), latents(named))
    with pytest.raises(TypeError, match=r"FlowPolicyBase needs family= .*choose_flow_family\(FluxTransformer2DModel\)"):
        FlowPolicyBase(**flux_components(tokenizer_dir), **FLUX_DEFAULTS)


def test_a_named_policy_refuses_another_familys_transformer_and_parts(tokenizer_dir):
    with pytest.raises(ValueError, match=r"FluxPolicy with the FLUX.1 family runs a FluxTransformer2DModel, not "
                                         r"SD3Transformer2DModel"):
        FluxPolicy(**sd3_components(tokenizer_dir), **SD3_OPTS)
    with pytest.raises(ValueError, match=r"FlowMatchingPolicy with the SD3 family runs a SD3Transformer2DModel, not "
                                         r"FluxTransformer2DModel"):
        FlowMatchingPolicy(**flux_components(tokenizer_dir), **FLUX_DEFAULTS)
    with pytest.raises(ValueError, match=r"FlowPolicyBase with the SD3 family runs a SD3Transformer2DModel"):
        FlowPolicyBase(**flux_components(tokenizer_dir), **FLUX_DEFAULTS, family=SD3Family)
    with pytest.raises(ValueError, match=r"FluxPolicy runs the FLUX.1 family, not the SD3 family: build "
                                         r"FlowPolicyBase\(family=SD3Family\)"):
        FluxPolicy(**flux_components(tokenizer_dir), **FLUX_DEFAULTS, family=SD3Family)
    parts = flux_components(tokenizer_dir)
    with pytest.raises(ValueError, match="FLUX.1 takes the text parts text_encoder, tokenizer, text_encoder_2, "
                                         "tokenizer_2; text_encoder_3 is not one of them"):
        FluxPolicy(**parts, text_encoder_3=parts["text_encoder"], tokenizer_3=parts["tokenizer"], **FLUX_DEFAULTS)
    with pytest.raises(ValueError, match="FLUX.1 takes the text parts .*; noise_levl is not one of them"):
        FluxPolicy(**parts, noise_levl=0.5)  # a misspelt keyword is named, not swallowed
    with pytest.raises(ValueError, match=r"FLUX.1 needs text_encoder_2 \(its text parts: text_encoder, tokenizer, "
                                         r"text_encoder_2, tokenizer_2\)"):
        FluxPolicy(**{**parts, "text_encoder_2": None}, **FLUX_DEFAULTS)
    with pytest.raises(ValueError, match="text_encoder_3 and tokenizer_3 go together"):
        FlowMatchingPolicy(**sd3_components(tokenizer_dir), tokenizer_3=object(), **SD3_OPTS)
    with pytest.raises(TypeError, match="positional"):
        FlowPolicyBase(*parts.values())  # the parts go by name


def test_unset_keywords_take_the_familys_defaults(tokenizer_dir):
    from unialign.image.families import SamplerKnobs

    sd3 = FlowMatchingPolicy(**sd3_components(tokenizer_dir), num_steps=2)
    assert (sd3.guidance_scale, sd3.max_sequence_length, sd3.height, sd3.width) == (4.5, 256, 16, 16)  # 8 x VAE 2
    assert (sd3.knobs.guidance_scale, sd3.knobs.max_sequence_length, sd3.knobs.height) == (4.5, 256, 16)
    flux = FluxPolicy(**flux_components(tokenizer_dir), knobs=SamplerKnobs(num_steps=2))
    assert (flux.guidance_scale, flux.max_sequence_length, flux.height, flux.width) == (3.5, 512, 256, 256)  # 128 x 2
    set_ = FluxPolicy(**flux_components(tokenizer_dir), guidance_scale=1.0, max_sequence_length=6, height=16, width=8)
    assert (set_.guidance_scale, set_.max_sequence_length, set_.height, set_.width) == (1.0, 6, 16, 8)


def test_from_pretrained_is_told_the_family(tmp_path):
    with pytest.raises(TypeError, match=r"FlowPolicyBase.from_pretrained needs family= .*resolve\(path\)"):
        FlowPolicyBase.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="load_t5=False: FLUX.1 cannot leave T5 out"):
        FluxPolicy.from_pretrained(str(tmp_path), load_t5=False)
