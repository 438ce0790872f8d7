"""Small Stable-Diffusion components built in code (no downloads), sized by the caller.

Same recipe as tests/image/conftest.py (diffusers' ``get_dummy_components`` style): a byte-level CLIP
tokenizer written to a temp folder, a tiny CLIP text encoder, a tiny VAE (scale factor 2), the SD1.5
DDIM scheduler config, and a ``UNet2DConditionModel`` whose width / depth / latent size are arguments.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

SD15_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                      clip_sample=False, set_alpha_to_one=False, steps_offset=1)
MAX_LEN = 16
BOS, EOS = 514, 515


from unialign.embedded.shapes_world import _bytes_to_unicode  # noqa: E402  (CLIP byte map, one copy)

_TOK_DIR: Path | None = None


def tokenizer():
    from transformers import CLIPTokenizer

    global _TOK_DIR
    if _TOK_DIR is None:
        _TOK_DIR = Path(tempfile.mkdtemp(prefix="bench_clip_tok_"))
        chars = list(_bytes_to_unicode().values())
        vocab = {c: i for i, c in enumerate(chars)}
        vocab.update({c + "</w>": i + 256 for i, c in enumerate(chars)})
        vocab["ca"], vocab["cat</w>"] = 512, 513
        vocab["<|startoftext|>"], vocab["<|endoftext|>"] = BOS, EOS
        (_TOK_DIR / "vocab.json").write_text(json.dumps(vocab))
        (_TOK_DIR / "merges.txt").write_text("#version: 0.2\nc a\nca t</w>\n")
    return CLIPTokenizer(str(_TOK_DIR / "vocab.json"), str(_TOK_DIR / "merges.txt"), model_max_length=MAX_LEN)


def text_encoder(hidden: int = 32):
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(vocab_size=520, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                         num_hidden_layers=2, max_position_embeddings=MAX_LEN, projection_dim=hidden,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, hidden_act="gelu")
    return CLIPTextModel(cfg).eval()


def vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                         norm_num_groups=4, layers_per_block=1, sample_size=16)


def unet(block_out_channels=(32, 64), sample_size: int = 32, cross_attention_dim: int = 32,
         layers_per_block: int = 2, attention_head_dim: int = 8):
    from diffusers import UNet2DConditionModel

    n = len(block_out_channels)
    down = ("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",)
    up = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1)
    return UNet2DConditionModel(sample_size=sample_size, in_channels=4, out_channels=4,
                                layers_per_block=layers_per_block, block_out_channels=tuple(block_out_channels),
                                down_block_types=down, up_block_types=up, cross_attention_dim=cross_attention_dim,
                                attention_head_dim=attention_head_dim, norm_num_groups=min(32, block_out_channels[0]))


def components(seed: int = 0, **unet_kw) -> dict:
    from diffusers import DDIMScheduler

    torch.manual_seed(seed)
    hidden = unet_kw.get("cross_attention_dim", 32)
    return dict(unet=unet(**unet_kw), vae=vae(), text_encoder=text_encoder(hidden), tokenizer=tokenizer(),
                scheduler=DDIMScheduler(**SD15_SCHEDULER))


PROMPTS = ["a cat", "a dog", "a red car", "a bowl of fruit", "a tree", "a house", "the sea", "a cat on a mat"]
