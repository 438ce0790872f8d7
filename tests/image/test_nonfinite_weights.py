"""A diffusers folder (or replacement VAE) whose weights hold NaN / inf is refused at load, naming the path, the
part and the first bad tensor."""

from __future__ import annotations

import math

import pytest
import torch

from tests.image.conftest import _vae, sd_components
from unialign.config import UserError
from unialign.image import DiffusionPolicy


def save_pipeline(tokenizer_dir, path, poison_part=None):
    from diffusers import StableDiffusionPipeline

    parts = sd_components(tokenizer_dir, seed=1)
    if poison_part is not None:
        with torch.no_grad():
            next(iter(parts[poison_part].parameters())).view(-1)[0] = math.nan
    StableDiffusionPipeline(**parts, safety_checker=None, feature_extractor=None,
                            requires_safety_checker=False).save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("part, tensor", [("unet", "conv_in.weight"), ("vae", "encoder.conv_in.weight"),
                                          ("text_encoder", "(text_model.)?embeddings.token_embedding.weight")])
def test_nonfinite_pipeline_parts_are_named_at_load(tokenizer_dir, tmp_path, part, tensor):
    path = save_pipeline(tokenizer_dir, tmp_path / "pipe", part)
    with pytest.raises(UserError, match=rf"model '{path}' \({part}\): weight '{tensor}' holds 1 NaN / inf values"):
        DiffusionPolicy.from_pretrained(path, num_steps=2)


def test_a_replacement_vae_is_named_by_its_own_path(tokenizer_dir, tmp_path):
    path = save_pipeline(tokenizer_dir, tmp_path / "pipe")
    DiffusionPolicy.from_pretrained(path, num_steps=2)  # finite: loads
    vae = _vae()
    with torch.no_grad():
        vae.decoder.conv_out.bias[1] = math.inf
    vae.save_pretrained(str(tmp_path / "vae"))
    with pytest.raises(UserError, match=rf"model '{tmp_path / 'vae'}': weight 'decoder.conv_out.bias' holds 1 NaN"):
        DiffusionPolicy.from_pretrained(path, num_steps=2, vae_name_or_path=str(tmp_path / "vae"))
