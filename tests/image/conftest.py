"""Tiny SD1.x and SDXL components built in code (diffusers' ``get_dummy_components`` style).

Latents 4x8x8, images 16x16, CLIP text encoders with hidden size 32 (SDXL: 32 + 16 with a 24-dim
projection), a byte-level CLIP tokenizer written into a temp folder. Every factory call with the same
seed gives the same weights, so "a fresh copy" of a model is one more call.
"""

from __future__ import annotations

import json

import pytest
import torch

SD15_SCHEDULER = dict(  # the SD1.5 / SDXL DDIM config (runwayml/stable-diffusion-v1-5 scheduler_config.json)
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    clip_sample=False, set_alpha_to_one=False, steps_offset=1,
)
MAX_LEN = 8
BOS, EOS = 514, 515  # ids of <|startoftext|>, <|endoftext|> in the tiny vocabulary below


from unialign.embedded.shapes_world import _bytes_to_unicode  # noqa: E402  (CLIP byte map, one copy)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": i + 256 for i, c in enumerate(chars)})
    vocab["ca"], vocab["cat</w>"] = 512, 513
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = BOS, EOS
    folder = tmp_path_factory.mktemp("clip_tokenizer")
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\nc a\nca t</w>\n")
    return folder


def _tokenizer(folder):
    from transformers import CLIPTokenizer

    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=MAX_LEN)


def _text_config(hidden: int, projection: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=520, hidden_size=hidden, intermediate_size=37, num_attention_heads=4,
                          num_hidden_layers=2, max_position_embeddings=MAX_LEN, projection_dim=projection,
                          bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, hidden_act="gelu")


def _vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                         norm_num_groups=4, layers_per_block=1, sample_size=16)


def sd_components(tokenizer_dir, seed: int = 0, prediction_type: str = "epsilon") -> dict:
    from diffusers import DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=4,
    )
    return dict(unet=unet, vae=_vae(), text_encoder=CLIPTextModel(_text_config(32)).eval(),
                tokenizer=_tokenizer(tokenizer_dir),
                scheduler=DDIMScheduler(**SD15_SCHEDULER, prediction_type=prediction_type))


def sdxl_components(tokenizer_dir, seed: int = 0) -> dict:
    from diffusers import DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), norm_num_groups=4, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, transformer_layers_per_block=(1, 1),
        cross_attention_dim=32 + 16,  # hidden sizes of text_encoder + text_encoder_2
        projection_class_embeddings_input_dim=6 * 8 + 24,  # 6 time ids x 8 + pooled (projection_dim 24)
    )
    return dict(unet=unet, vae=_vae(), text_encoder=CLIPTextModel(_text_config(32)).eval(),
                tokenizer=_tokenizer(tokenizer_dir),
                text_encoder_2=CLIPTextModelWithProjection(_text_config(16, projection=24)).eval(),
                tokenizer_2=_tokenizer(tokenizer_dir), scheduler=DDIMScheduler(**SD15_SCHEDULER))


POLICY_DEFAULTS = dict(num_steps=4, guidance_scale=3.0, eta=1.0)


@pytest.fixture
def make_policy(tokenizer_dir):
    """make_policy(kind="sd"|"sdxl", seed=0, prediction_type=..., **policy_kwargs) -> DiffusionPolicy."""
    from unialign.image import DiffusionPolicy

    def factory(kind: str = "sd", seed: int = 0, prediction_type: str = "epsilon", **kwargs):
        parts = (sd_components(tokenizer_dir, seed, prediction_type) if kind == "sd"
                 else sdxl_components(tokenizer_dir, seed))
        return DiffusionPolicy(**parts, **{**POLICY_DEFAULTS, **kwargs})

    return factory


def log_probs_around_a_lora_move(policy, reference, trajectory, by: float = 0.3):
    """(reference log-probs before, policy's after, reference's after) of ``trajectory`` around adding ``by`` to
    every LoRA B matrix of the policy's denoiser (all zero at construction: the policy then differs from its
    reference, which must not move)."""
    with torch.no_grad():
        before = reference.log_prob(trajectory)
        for name, p in policy.denoiser.named_parameters():
            if "lora_B" in name:
                p.add_(by)
        return before, policy.log_prob(trajectory), reference.log_prob(trajectory)


def colour_pairs(prompts: list[str], n: int = 3, rejected_size: tuple[int, int] = (24, 16)) -> list[dict]:
    """``n`` preference rows cycling ``prompts``: a 16x16 reddish chosen image and a greenish rejected one of
    ``rejected_size`` (not square: the resize / crop path runs)."""
    from PIL import Image

    return [{"prompt": prompts[i % len(prompts)], "chosen": Image.new("RGB", (16, 16), (200, 30 * i, 30)),
             "rejected": Image.new("RGB", rejected_size, (40, 90, 10 * i))} for i in range(n)]


def stock_pipeline(tokenizer_dir, kind: str, seed: int = 0):
    """The stock diffusers pipeline of the tiny ``kind`` ("sd" / "sdxl") components of ``seed`` (SD1.x without its
    safety checker)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    if kind == "sd":
        return StableDiffusionPipeline(**sd_components(tokenizer_dir, seed=seed), safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
    return StableDiffusionXLPipeline(**sdxl_components(tokenizer_dir, seed=seed))
