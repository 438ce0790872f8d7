"""The offline "embedded default" for image RL: captioned synthetic shapes, a computable gold score, and
tiny models built from them (a CLIP, a LAION-shaped aesthetic head, an SDXL-architecture diffusion model).

Why this exists
---------------
``scripts/ddpo_aesthetic.py`` must run with no arguments, offline, on two CPU cores in a few minutes, and
show that RL raises an aesthetic reward. Stable Diffusion, CLIP ViT-L/14 and the LAION head cannot be
downloaded here and are far too slow on CPU. So the package ships its own small stand-ins, built in
code by ``tools/build_shapes_world.py`` (in the source checkout, not installed) into
``unialign/embedded/assets/image`` (numbers and timings in ``BUILD.md`` there). This module holds what a run needs
(data, gold score, tokenizer, loaders); the training recipe that builds the assets is that tool's.

The data
--------
32x32 RGB images of one shape (circle / square / triangle) of one of 8 colours on a background of
another of the 8 colours, at a random size and position, drawn at 4x and box-downsampled (anti-aliased).
Prompts are ``"a red circle on a blue background"`` (3 x 8 x 7 = 168); about 1/8 of them, chosen by a
hash of the prompt, are held out of every training stage (``prompts("test")``). Rendering is pure
PIL/numpy with a seeded ``random.Random``, so the data set is identical on every machine.

The gold score
--------------
``gold_score(images)`` is a documented pixel statistic standing in for human aesthetic ratings:

    gold = colourfulness / 200 + rms_contrast

* colourfulness: Hasler & Suesstrunk (2003), on 0..255 RGB: rg = R - G, yb = (R + G) / 2 - B,
  M = sqrt(std(rg)^2 + std(yb)^2) + 0.3 * sqrt(mean(rg)^2 + mean(yb)^2) (population std, per image);
  0 for grey images, about 85 for a flat pure red, up to ~150 for saturated complementary colours.
* rms_contrast: population std of the luminance Y = 0.299 R + 0.587 G + 0.114 B in [0, 1]; at most 0.5.

Both terms are therefore of order 0..0.75. Saturated, complementary, large shapes score high; grey,
blurred, faded or dark images score low, which gives RL a reward with spread.

The models
----------
* tokenizer: a CLIP BPE tokenizer whose ``vocab.json`` / ``merges.txt`` are written in code: the 512
  byte-level symbols of CLIP's BPE (so any text tokenizes) plus one token per caption word (merge chains
  make each caption word a single token), ``<|startoftext|>`` and ``<|endoftext|>`` last (the largest id,
  so open_clip's ``argmax`` pooling finds it). ``transformers.CLIPTokenizer`` loads it.
* CLIP: ``open_clip.model.CLIP`` with a tiny ViT (32 px, patch 4, width 64, 2 layers) and a tiny text
  transformer (context 16, width 64, 2 layers), embedding dim 64, trained contrastively (InfoNCE) on
  captions that also name the size ("small / large") and the degradation ("blurry / faded / noisy /
  dark") of augmented images, so its embedding carries them as a real CLIP's does.
* aesthetic head: ``AestheticMLP`` (the LAION improved-aesthetic-predictor shape, 64 -> 1024 -> 128 ->
  64 -> 16 -> 1, no activations) on the L2-normalised CLIP image embedding, trained with MSE to predict
  ``gold_score`` on clean and degraded images AND on "policy-space" images (``policy_space_images``:
  VAE decodes of data, noised and random latents, and the diffusion model's own samples at CFG 0-6).
  Every image a DDPO policy produces is a VAE decode, so this keeps the reward faithful where RL goes;
  trained on dataset images only, the head rated the blotchy images of a policy pushed off its manifold
  above the base model's samples while their gold score fell (reward hacking within a few steps).
  Built last (it needs the saved diffusion model); ``build-head`` re-runs only this stage.
* diffusion model: the SDXL architecture in miniature: ``UNet2DConditionModel`` with
  ``addition_embed_type="text_time"``, ``CLIPTextModel`` + ``CLIPTextModelWithProjection``, a 3-level
  ``AutoencoderKL`` (32x32x3 <-> 4x8x8), SD's ``DDIMScheduler`` config; epsilon-prediction trained on the
  training prompts with 10% prompt dropout to zero conditioning (SDXL's ``force_zeros_for_empty_prompt``),
  so classifier-free guidance works. Saved with ``StableDiffusionXLPipeline.save_pretrained``. The VAE is
  trained long enough to keep what a prompt asks for (the shape verifier reads 98 % of its round trips
  right; at the first build's 200 steps, 53 %), the UNet only to half-learn shapes: held-out prompt
  fidelity 0.51 without CFG, 0.69 at CFG 3 (``BUILD.md``), the room an RL demo needs.

* flow-matching model (``sd3/``, ``load_embedded_sd3``): the SD3 architecture in miniature for
  ``FlowMatchingPolicy`` (Flow-GRPO): ``SD3Transformer2DModel`` (4x8x8 latents, patch 2, width 64, 2 joint
  blocks), two ``CLIPTextModelWithProjection`` and no T5 (``SD3_MAX_SEQUENCE_LENGTH`` zero tokens), the VAE
  above with ``shift_factor`` 0, ``FlowMatchEulerDiscreteScheduler`` (shift 1); rectified-flow training on the
  same images with 10% empty-prompt dropout. Saved with ``StableDiffusion3Pipeline.save_pretrained``; like the
  UNet it half-learns shapes (held-out fidelity ~0.5 at CFG 1, ~0.74 at CFG 3 with the SDE sampler, ``BUILD.md``).

Prompt fidelity is read by the verifiable reward ``unialign.embedded.shape_verifier`` (``shape_verifier``), which
decides background colour, object colour and shape from pixels alone.

The builder (``tools/build_shapes_world.py``; from the repository root of a source checkout)::

    python -m tools.build_shapes_world build --out unialign/embedded/assets/image   # deterministic rebuild
    python -m tools.build_shapes_world build-head --out unialign/embedded/assets/image   # only the (last) head stage
    python -m tools.build_shapes_world build-sd3 --out unialign/embedded/assets/image    # the SD3 model (after build)
    python -m tools.build_shapes_world eval [--path DIR] [--n 64]           # reward / gold statistics
    python -m tools.build_shapes_world check --stage data    # a stage rebuilt in a temp folder against the shipped files
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

Tensor = torch.Tensor

DEFAULT_ASSET_DIR = Path(__file__).resolve().parent / "assets" / "image"
IMAGE_SIZE = 32
SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (40, 170, 60), "blue": (35, 70, 220), "yellow": (240, 210, 40),
    "purple": (140, 50, 180), "orange": (245, 130, 20), "white": (245, 245, 245), "black": (15, 15, 15),
}
SIZES = {"small": (0.16, 0.24), "medium": (0.26, 0.34), "large": (0.36, 0.46)}  # half-extent / image side
DEGRADATIONS = ("blurry", "faded", "noisy", "dark")
CONTEXT_LENGTH = 16
BOS_TOKEN, EOS_TOKEN = "<|startoftext|>", "<|endoftext|>"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's, as every open_clip "openai" model
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# What a DDPO script should use with this model (see BUILD.md for the measured reward statistics).
SAMPLING_DEFAULTS = dict(num_steps=16, guidance_scale=3.0, eta=1.0, height=IMAGE_SIZE, width=IMAGE_SIZE)
# The embedded SD3-architecture (flow-matching) model: its folder, the length of the T5 zero block it was
# trained with (no T5 ships: the stock pipeline and FlowMatchingPolicy fill max_sequence_length zero tokens,
# so a stock call must pass max_sequence_length=SD3_MAX_SEQUENCE_LENGTH), and what a Flow-GRPO script should use.
SD3_DIR = DEFAULT_ASSET_DIR / "sd3"
SD3_MAX_SEQUENCE_LENGTH = 8
SD3_SAMPLING_DEFAULTS = dict(num_steps=10, guidance_scale=1.0, noise_level=0.7, sde_type="sde", height=IMAGE_SIZE,
                             width=IMAGE_SIZE, max_sequence_length=SD3_MAX_SEQUENCE_LENGTH)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def caption(shape: str, colour: str, background: str, size: str | None = None,
            degradation: str | None = None) -> str:
    """``"a [degradation] [size] colour shape on a background background"``."""
    words = ["a"] + ([degradation] if degradation else []) + ([size] if size else [])
    return " ".join(words + [colour, shape, "on", "a", background, "background"])


def _is_test(prompt: str) -> bool:
    return int(hashlib.md5(prompt.encode()).hexdigest(), 16) % 8 == 0


def all_prompts() -> list[tuple[str, str, str]]:
    """Every (shape, colour, background) with colour != background, in a fixed order."""
    return [(s, c, b) for s in SHAPES for c in COLOURS for b in COLOURS if c != b]


def prompts(split: str = "train") -> list[str]:
    """The plain prompts of ``split`` ("train", "test" or "all"), in a fixed order."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    out = [caption(*spec) for spec in all_prompts()]
    if split == "all":
        return out
    return [p for p in out if _is_test(p) == (split == "test")]


def render(shape: str, colour: str, background: str, cx: float, cy: float, half: float,
           size: int = IMAGE_SIZE, supersample: int = 4):
    """One anti-aliased PIL RGB image: ``shape`` centred at (cx, cy) with half-extent ``half`` (all as
    fractions of the side), drawn at ``supersample`` x and box-downsampled."""
    from PIL import Image, ImageDraw

    big = size * supersample
    image = Image.new("RGB", (big, big), COLOURS[background])
    draw = ImageDraw.Draw(image)
    x, y, h = cx * big, cy * big, half * big
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse([x - h, y - h, x + h, y + h], fill=fill)
    elif shape == "square":
        s = h * 0.9  # same visual area as the circle, roughly
        draw.rectangle([x - s, y - s, x + s, y + s], fill=fill)
    elif shape == "triangle":
        draw.polygon([(x, y - h), (x - h * 1.1, y + h * 0.8), (x + h * 1.1, y + h * 0.8)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return image.resize((size, size), Image.BOX)


@dataclass
class ShapeSample:
    image: Any  # PIL.Image
    prompt: str  # plain prompt ("a red circle on a blue background")
    shape: str
    colour: str
    background: str
    size: str  # "small" / "medium" / "large"


def shape_dataset(split: str = "train", per_prompt: int = 8, seed: int = 0) -> list[ShapeSample]:
    """``per_prompt`` clean images for every prompt of ``split``, with sizes and positions drawn from a
    ``random.Random`` seeded by (seed, prompt): deterministic, and independent of the other prompts."""
    out = []
    for spec in all_prompts():
        prompt = caption(*spec)
        if split != "all" and _is_test(prompt) != (split == "test"):
            continue
        rng = random.Random(f"{seed}:{prompt}")
        for _ in range(per_prompt):
            size = rng.choice(list(SIZES))
            half = rng.uniform(*SIZES[size])
            margin = half * 1.1 + 0.02
            cx, cy = rng.uniform(margin, 1 - margin), rng.uniform(margin, 1 - margin)
            out.append(ShapeSample(render(*spec, cx, cy, half), prompt, *spec, size))
    return out


def to_tensor(images) -> Tensor:
    """PIL images / uint8 [B,3,H,W] / float [B,3,H,W] in [0, 1] -> float32 [B,3,H,W] in [0, 1]."""
    if isinstance(images, Tensor):
        x = images.detach().cpu()
        return x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    arrays = [np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0 for im in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def degrade(x_B_3_H_W: Tensor, kind: str, strength: Tensor, generator: torch.Generator) -> Tensor:
    """Degrade images in [0, 1] (``strength`` [B] in [0, 1]): ``blurry`` (box blur mixed in), ``faded``
    (towards the grey mean: less saturation and contrast), ``noisy`` (Gaussian noise), ``dark``."""
    s = strength.view(-1, 1, 1, 1)
    if kind == "blurry":
        blurred = F.avg_pool2d(F.pad(x_B_3_H_W, (2, 2, 2, 2), mode="replicate"), 5, stride=1)
        out = x_B_3_H_W + s * (blurred - x_B_3_H_W)
    elif kind == "faded":
        grey = x_B_3_H_W.mean(dim=(1, 2, 3), keepdim=True)
        out = x_B_3_H_W + 0.8 * s * (grey - x_B_3_H_W)
    elif kind == "noisy":
        out = x_B_3_H_W + 0.25 * s * torch.randn(x_B_3_H_W.shape, generator=generator)
    elif kind == "dark":
        out = x_B_3_H_W * (1 - 0.7 * s)
    else:
        raise ValueError(f"unknown degradation {kind!r}")
    return out.clamp(0, 1)


# ---------------------------------------------------------------------------------------------
# Gold score
# ---------------------------------------------------------------------------------------------
def colourfulness(images) -> Tensor:
    """Hasler & Suesstrunk (2003) colourfulness per image, on 0..255 RGB (see module docstring). [B]"""
    x = to_tensor(images).double() * 255.0
    r, g, b = x[:, 0].flatten(1), x[:, 1].flatten(1), x[:, 2].flatten(1)
    rg, yb = r - g, 0.5 * (r + g) - b
    std = torch.sqrt(rg.var(dim=1, unbiased=False) + yb.var(dim=1, unbiased=False))
    mean = torch.sqrt(rg.mean(dim=1) ** 2 + yb.mean(dim=1) ** 2)
    return (std + 0.3 * mean).float()


def rms_contrast(images) -> Tensor:
    """Population std of the luminance 0.299 R + 0.587 G + 0.114 B, RGB in [0, 1]. [B]"""
    x = to_tensor(images).double()
    y = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    return y.flatten(1).std(dim=1, unbiased=False).float()


def gold_score(images) -> Tensor:
    """The embedded default's ground-truth "aesthetic": colourfulness / 200 + rms_contrast. [B] float32.
    ``images``: PIL images, uint8 [B,3,H,W], or float [B,3,H,W] in [0, 1]."""
    return colourfulness(images) / 200.0 + rms_contrast(images)


# ---------------------------------------------------------------------------------------------
# Tokenizer (written in code)
# ---------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte -> printable unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def caption_words() -> list[str]:
    words = {"a", "on", "background", *SHAPES, *COLOURS, *SIZES, *DEGRADATIONS}
    return sorted(words)


def write_tokenizer(folder: str | Path, words: list[str] | None = None) -> Path:
    """Write ``vocab.json`` / ``merges.txt`` of the tiny CLIP BPE tokenizer (see module docstring) with one token
    per word of ``words`` (default: ``caption_words()``; the motion world adds its own)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": i + 256 for i, c in enumerate(chars)})
    merges: list[tuple[str, str]] = []
    for word in (caption_words() if words is None else words):
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        left = symbols[0]
        for right in symbols[1:]:
            pair = (left, right)
            if pair not in merges:
                merges.append(pair)
            left = left + right
            vocab.setdefault(left, len(vocab))
    vocab[BOS_TOKEN] = len(vocab)
    vocab[EOS_TOKEN] = len(vocab)  # the largest id: open_clip pools the text at argmax(ids)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=0))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return folder


def load_tokenizer(folder: str | Path):
    from transformers import CLIPTokenizer

    folder = Path(folder)
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=CONTEXT_LENGTH,
                         pad_token=EOS_TOKEN)


def tokenize(tokenizer, texts: list[str]) -> Tensor:
    """Token ids [B, CONTEXT_LENGTH]: BOS, tokens, EOS, EOS padding (truncated to fit)."""
    return tokenizer(list(texts), padding="max_length", max_length=CONTEXT_LENGTH, truncation=True,
                     return_tensors="pt").input_ids


# ---------------------------------------------------------------------------------------------
# Tiny CLIP (open_clip)
# ---------------------------------------------------------------------------------------------
def clip_config(vocab_size: int) -> dict[str, Any]:
    return dict(
        embed_dim=64,
        vision_cfg=dict(image_size=IMAGE_SIZE, patch_size=4, width=64, layers=2, head_width=32, mlp_ratio=2.0),
        text_cfg=dict(context_length=CONTEXT_LENGTH, vocab_size=vocab_size, width=64, heads=2, layers=2,
                      mlp_ratio=2.0),
    )


def build_clip(config: dict[str, Any]):
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    return CLIP(embed_dim=config["embed_dim"], vision_cfg=CLIPVisionCfg(**config["vision_cfg"]),
                text_cfg=CLIPTextCfg(**config["text_cfg"]))


@dataclass
class EmbeddedClip:
    """The shipped tiny open_clip model with what is needed to use it like a real one."""

    model: torch.nn.Module  # open_clip.model.CLIP, eval mode
    tokenizer: Any  # transformers.CLIPTokenizer

    image_size: int = IMAGE_SIZE
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    def tokenize(self, texts: list[str]) -> Tensor:
        return tokenize(self.tokenizer, texts)


def load_embedded_clip(path: str | Path | None = None, device: str | torch.device | None = None) -> EmbeddedClip:
    """The tiny CLIP of ``path`` (default: the shipped assets) in eval mode."""
    from safetensors.torch import load_file

    root = _asset_dir(path)
    config = json.loads((root / "clip" / "open_clip_config.json").read_text())
    model = build_clip(config["model_cfg"])
    model.load_state_dict(load_file(str(root / "clip" / "open_clip_model.safetensors")))
    pre = config["preprocess_cfg"]
    return EmbeddedClip(model.eval().requires_grad_(False).to(device or "cpu"), load_tokenizer(root / "tokenizer"),
                        image_size=pre["size"], mean=tuple(pre["mean"]), std=tuple(pre["std"]))


def load_embedded_head(path: str | Path | None = None, device: str | torch.device | None = None):
    """The LAION-shaped aesthetic head of ``path`` (default: the shipped assets), eval mode."""
    from unialign.rewards.image import AestheticMLP

    root = _asset_dir(path)
    state = torch.load(root / "aesthetic_head.pth", map_location="cpu", weights_only=True)
    head = AestheticMLP(state["layers.0.weight"].shape[1])
    head.load_state_dict(state)
    return head.eval().requires_grad_(False).to(device or "cpu")


def load_embedded(path: str | Path | None = None, device: str | torch.device | None = None,
                  **policy_kwargs: Any):
    """The shipped tiny SDXL-architecture model as a ``DiffusionPolicy`` (``SAMPLING_DEFAULTS`` unless
    overridden by ``policy_kwargs``)."""
    from unialign.image.policy import DiffusionPolicy

    kwargs = {**SAMPLING_DEFAULTS, **policy_kwargs}
    return DiffusionPolicy.from_pretrained(str(pipeline_dir(path)), device=device, **kwargs)


def sd3_dir(path: str | Path | None = None) -> Path:
    """The diffusers ``StableDiffusion3Pipeline`` folder of the embedded flow-matching model: ``path`` itself
    when it holds a ``model_index.json``, else ``path / "sd3"`` (``path``: an asset root; default ``SD3_DIR``)."""
    if path is None:
        folder = SD3_DIR
    else:
        folder = Path(path) if (Path(path) / "model_index.json").exists() else Path(path) / "sd3"
    if not (folder / "model_index.json").exists():
        raise FileNotFoundError(f"no embedded SD3 model in {folder}; build it with "
                                f"`python -m tools.build_shapes_world build-sd3 --out {folder.parent}` (a source checkout)")
    return folder


def load_embedded_sd3(path: str | Path | None = None, device: str | torch.device | None = None,
                      **policy_kwargs: Any):
    """The shipped tiny SD3-architecture model as a ``FlowMatchingPolicy`` (``SD3_SAMPLING_DEFAULTS`` unless
    overridden by ``policy_kwargs``: 10 steps, Flow-GRPO's SDE step at noise level 0.7, CFG 1, the T5 zero
    block it was trained with). ``path``: an asset root or the SD3 folder itself (``sd3_dir``)."""
    from unialign.image.flow_policy import FlowMatchingPolicy

    kwargs = {**SD3_SAMPLING_DEFAULTS, **policy_kwargs}
    return FlowMatchingPolicy.from_pretrained(str(sd3_dir(path)), device=device, **kwargs)


def aesthetic_reward(path: str | Path | None = None, device: str | torch.device | None = None,
                     batch_size: int = 32):
    """``AestheticReward`` on the tiny CLIP + LAION-shaped head of ``path`` (default: the shipped assets),
    trained on ``gold_score``."""
    from unialign.rewards.image import AestheticReward

    return AestheticReward(clip=load_embedded_clip(path), head=load_embedded_head(path), device=device,
                           batch_size=batch_size)


def clip_score_reward(path: str | Path | None = None, device: str | torch.device | None = None,
                      batch_size: int = 32, **kwargs: Any):
    """``ClipScoreReward`` with the tiny CLIP of ``path`` (trained on the synthetic shape captions)."""
    from unialign.rewards.image import ClipScoreReward

    return ClipScoreReward(clip=load_embedded_clip(path), device=device, batch_size=batch_size, **kwargs)


def reward_kwargs(name: str) -> dict[str, Any]:
    """The keyword arguments that make the registry's model-based reward ``name`` use the shipped tiny
    CLIP / aesthetic head instead of hub weights, the pixel detector for GenEval ({} for the others)."""
    if name == "aesthetic":
        return {"clip": load_embedded_clip(), "head": load_embedded_head()}
    if name == "clip_score":
        return {"clip": load_embedded_clip()}
    if name == "geneval":  # GenEval's rules read by the pixel detector (unialign/embedded/geneval_shapes.py)
        return {"backend": "shapes"}
    return {}


def pipeline_dir(path: str | Path | None = None) -> Path:
    """The diffusers pipeline folder (``model_index.json``, ``unet/``, ...) of the embedded model."""
    return _asset_dir(path) / "sdxl"


def _asset_dir(path: str | Path | None) -> Path:
    root = Path(path) if path is not None else DEFAULT_ASSET_DIR
    if not (root / "sdxl" / "model_index.json").exists() and not (root / "clip").exists():
        raise FileNotFoundError(f"no embedded image assets in {root}; build them with "
                                f"`python -m tools.build_shapes_world build --out {root}` (a source checkout)")
    return root
