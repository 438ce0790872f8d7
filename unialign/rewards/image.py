"""Image rewards: JPEG (in)compressibility, the LAION aesthetic predictor, CLIP score, and the human-preference
models PickScore (transformers CLIP-H, its processor's preprocessing) and HPSv2 (open_clip ViT-H-14).

Every reward is a class with TRL's reward signature: ``reward(prompts=..., completions=images) ->
list[float]``, where ``completions`` are PIL images, a uint8 tensor [B,3,H,W] (0..255) or a float tensor
[B,3,H,W] in [0, 1] (what ``DiffusionPolicy`` / diffusers pipelines return after ``/2 + 0.5``).
Model-based rewards run batched (``batch_size``) under ``torch.no_grad()`` on ``device``.
open_clip / PIL / huggingface_hub are imported inside the classes, so importing this module is cheap.

Preprocessing (pinned, ``clip_preprocess``): each image is turned into an 8-bit RGB PIL image (tensors:
``round(x * 255)``), resized so its **shortest side** is the CLIP input size with PIL **bicubic**
resampling, **center-cropped** (top-left offset ``round((H - S) / 2)``, torchvision's rule), scaled to
[0, 1] and normalised with the CLIP mean/std. This is open_clip's eval transform for the "openai" models
(``resize_mode="shortest"``, ``interpolation="bicubic"``); transformers' ``CLIPProcessor`` (used by
ddpo-pytorch / TRL) differs slightly per pixel. ``PickScoreReward`` uses
that processor (its PIL backend), as PickScore was published with it; HPSv2's ``preprocess_val`` is the
pinned transform.

Hub weights are never fetched silently in a loop: each model-based reward checks the Hub once in
``__init__`` (``unialign.hub.require_hub``) and raises ``HubUnavailableError`` (a RuntimeError) within
seconds when offline. A CLIP model already in memory (``clip=``: anything with ``model``, ``tokenize``,
``image_size``, ``mean``, ``std``) and, for the aesthetic score, a head module (``head=``) skip every
download: that is how a small local model (e.g. the demo package's) is scored.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

Tensor = torch.Tensor

# Copy of LAION's sac+logos+ava1-l14-linearMSE.pth published for TRL's DDPO example
# (huggingface/trl examples/scripts/ddpo.py: hf_hub_aesthetic_model_id / _filename).
AESTHETIC_HEAD_REPO = "trl-lib/ddpo-aesthetic-predictor"
AESTHETIC_HEAD_FILENAME = "aesthetic-model.pth"


# ---------------------------------------------------------------------------------------------
# Image conversion and the pinned CLIP preprocessing
# ---------------------------------------------------------------------------------------------
def to_pil_images(images: Any) -> list:
    """PIL images (RGB) from PIL images, a uint8 tensor/array [B,3,H,W], a float tensor/array [B,3,H,W]
    in [0, 1] (rounded to 8 bits as ddpo-pytorch does), or a list of such [3,H,W] / [H,W,3] arrays."""
    from PIL import Image

    if isinstance(images, (Tensor, np.ndarray)) and images.ndim == 4:
        images = list(images)
    if isinstance(images, (Tensor, np.ndarray)) and images.ndim == 3:
        images = [images]
    out = []
    for im in images:
        if isinstance(im, Image.Image):
            out.append(im.convert("RGB"))
            continue
        arr = im.detach().cpu().numpy() if isinstance(im, Tensor) else np.asarray(im)
        if arr.ndim != 3:
            raise ValueError(f"expected an image [3,H,W] or [H,W,3], got shape {arr.shape}")
        if arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3):
            arr = arr.transpose(1, 2, 0)  # CHW -> HWC
        if arr.dtype != np.uint8:
            arr = (np.clip(arr.astype(np.float64), 0.0, 1.0) * 255.0).round().astype(np.uint8)
        if arr.shape[-1] == 1:
            arr = np.repeat(arr, 3, axis=-1)
        out.append(Image.fromarray(np.ascontiguousarray(arr), "RGB"))
    return out


def clip_preprocess(images: Any, image_size: int = 224, mean: Sequence[float] = (0.48145466, 0.4578275, 0.40821073),
                    std: Sequence[float] = (0.26862954, 0.26130258, 0.27577711)) -> Tensor:
    """The pinned CLIP eval transform (module docstring) -> float32 [B, 3, image_size, image_size]."""
    from PIL import Image

    out = []
    for im in to_pil_images(images):
        w, h = im.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = image_size, int(image_size * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        if (new_w, new_h) != (w, h):
            im = im.resize((new_w, new_h), Image.BICUBIC)
        top, left = int(round((new_h - image_size) / 2.0)), int(round((new_w - image_size) / 2.0))
        im = im.crop((left, top, left + image_size, top + image_size))
        out.append(np.asarray(im, dtype=np.float32) / 255.0)
    x = torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2)
    return ((x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)).contiguous()


# ---------------------------------------------------------------------------------------------
# JPEG
# ---------------------------------------------------------------------------------------------
def jpeg_size_kb(images: Any, quality: int = 95) -> list[float]:
    """Size in kB (1000 bytes) of each image saved as JPEG at ``quality`` (ddpo-pytorch's rewards.py)."""
    sizes = []
    for im in to_pil_images(images):
        buffer = io.BytesIO()
        im.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return sizes


class JpegCompressibilityReward:
    """``-(JPEG size in kB)`` at ``quality`` (DDPO's "compressibility", Black et al. 2023)."""

    name = "jpeg_compressibility"

    def __init__(self, quality: int = 95) -> None:
        self.quality = quality

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        return [-s for s in jpeg_size_kb(completions, self.quality)]


class JpegIncompressibilityReward(JpegCompressibilityReward):
    """``+(JPEG size in kB)`` at ``quality`` (DDPO's "incompressibility")."""

    name = "jpeg_incompressibility"

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        return jpeg_size_kb(completions, self.quality)


# ---------------------------------------------------------------------------------------------
# CLIP-based rewards
# ---------------------------------------------------------------------------------------------
class AestheticMLP(nn.Module):
    """LAION improved-aesthetic-predictor head (christophschuhmann/improved-aesthetic-predictor): five
    Linear layers with dropout and **no activations** ("linearMSE"), on an L2-normalised CLIP image
    embedding of size ``input_dim`` (768 for ViT-L/14). State-dict keys match
    ``sac+logos+ava1-l14-linearMSE.pth``: ``layers.{0,2,4,6,7}.{weight,bias}``."""

    def __init__(self, input_dim: int = 768) -> None:
        super().__init__()
        self.input_dim = input_dim
        self.layers = nn.Sequential(
            nn.Linear(input_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed_B_D: Tensor) -> Tensor:
        """[B, D] -> [B, 1]"""
        return self.layers(embed_B_D)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _load_open_clip(model_name: str, pretrained: str, device: torch.device):
    """An open_clip model (eval, no grad) and its (image_size, mean, std); checks the Hub first."""
    import open_clip

    from unialign.hub import require_hub

    if not os.path.isfile(pretrained):
        cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
        if not cfg:
            raise ValueError(f"open_clip has no pretrained tag {pretrained!r} for {model_name!r}")
        hub_id = (cfg.get("hf_hub") or "").strip("/")
        if hub_id:
            require_hub(hub_id)
        else:  # weights only at a URL: offline is still offline
            require_hub(f"open_clip:{model_name}/{pretrained}")
    model = open_clip.create_model(model_name, pretrained=pretrained, device=device)
    size, mean, std = open_clip_preprocess(model, f"{model_name}/{pretrained}", "only shortest-side bicubic resize "
                                           "+ center crop is implemented (pinned)")
    return model.eval().requires_grad_(False), size, mean, std


def open_clip_preprocess(model, what: str, only: str) -> tuple[int, tuple, tuple]:
    """(image side, mean, std) of an open_clip model's ``preprocess_cfg``; ValueError naming ``what`` and saying
    ``only`` when it asks for other than the pinned shortest-side bicubic resize + center crop."""
    pre = model.visual.preprocess_cfg
    size = pre.get("size", model.visual.image_size)
    size = size[0] if isinstance(size, (tuple, list)) else size
    if pre.get("resize_mode", "shortest") != "shortest" or pre.get("interpolation", "bicubic") != "bicubic":
        raise ValueError(f"{what} wants preprocessing {pre}; {only}")
    return int(size), tuple(pre["mean"]), tuple(pre["std"])


class _ClipReward:
    """Shared machinery: a CLIP model with ``encode_image`` / ``encode_text``, a tokenizer function,
    the pinned preprocessing, batching and device placement."""

    def __init__(self, model, tokenize, image_size: int, mean, std, device, batch_size: int) -> None:
        self.model, self._tokenize = model, tokenize
        self.image_size, self.mean, self.std = image_size, tuple(mean), tuple(std)
        self.device = _resolve_device(device)
        self.batch_size = batch_size
        self.model.to(self.device)

    def preprocess(self, images: Any) -> Tensor:
        """Pinned preprocessing -> [B, 3, S, S] on CPU (module docstring)."""
        return clip_preprocess(images, self.image_size, self.mean, self.std)

    @torch.no_grad()
    def image_embeddings(self, images: Any) -> Tensor:
        """L2-normalised float32 image embeddings [B, D] (on ``self.device``)."""
        pils = to_pil_images(images)
        out = []
        for i in range(0, len(pils), self.batch_size):
            x = self.preprocess(pils[i:i + self.batch_size]).to(self.device)
            out.append(nn.functional.normalize(self.model.encode_image(x).float(), dim=-1))
        return torch.cat(out)

    @torch.no_grad()
    def text_embeddings(self, texts: list[str]) -> Tensor:
        """L2-normalised float32 text embeddings [B, D] (on ``self.device``)."""
        out = []
        for i in range(0, len(texts), self.batch_size):
            ids = self._tokenize(list(texts[i:i + self.batch_size])).to(self.device)
            out.append(nn.functional.normalize(self.model.encode_text(ids).float(), dim=-1))
        return torch.cat(out)


class AestheticReward(_ClipReward):
    """LAION aesthetic score: ``AestheticMLP(normalise(CLIP_image(x)))`` (≈ 1..10 for real images with
    the published head).

    Args:
        clip_model, pretrained: open_clip model name and pretrained tag or local checkpoint file
            (default ViT-L-14 / openai, the head's training embedding).
        head_path: a local head state dict (``.pth``); default downloads ``AESTHETIC_HEAD_FILENAME`` from
            the Hub repo ``AESTHETIC_HEAD_REPO`` (TRL's copy of ``sac+logos+ava1-l14-linearMSE.pth``)
            and loads it with ``torch.load(..., weights_only=True)``.
        device: default CUDA when available.  batch_size: images per CLIP forward.
        clip, head: a CLIP already loaded (``model`` / ``tokenize`` / ``image_size`` / ``mean`` / ``std``) and
            an ``AestheticMLP`` for its embedding; given, nothing is downloaded and the other model arguments
            are ignored.
    Offline without cached weights: ``HubUnavailableError`` (a RuntimeError) at construction.
    """

    name = "aesthetic"

    def __init__(self, clip_model: str = "ViT-L-14", pretrained: str = "openai", head_path: str | None = None,
                 device: str | torch.device | None = None, batch_size: int = 32, clip: Any = None,
                 head: nn.Module | None = None) -> None:
        if clip is not None:
            if head is None:
                raise ValueError("aesthetic: a preloaded clip needs its head (head=AestheticMLP)")
            super().__init__(clip.model, clip.tokenize, clip.image_size, clip.mean, clip.std, device, batch_size)
            self.head = head.to(self.device)
            return
        from unialign.hub import require_hub

        if head_path is None:  # check both downloads before loading anything (fail fast)
            require_hub(AESTHETIC_HEAD_REPO)
        model, size, mean, std = _load_open_clip(clip_model, pretrained, _resolve_device(device))
        super().__init__(model, None, size, mean, std, device, batch_size)
        if head_path is None:
            from huggingface_hub import hf_hub_download

            head_path = hf_hub_download(AESTHETIC_HEAD_REPO, AESTHETIC_HEAD_FILENAME)
        state = torch.load(head_path, map_location="cpu", weights_only=True)
        self.head = AestheticMLP(state["layers.0.weight"].shape[1])
        self.head.load_state_dict(state)
        self.head.eval().requires_grad_(False).to(self.device)

    @torch.no_grad()
    def scores(self, images: Any) -> Tensor:
        """float32 [B] on CPU."""
        return self.head(self.image_embeddings(images)).squeeze(-1).float().cpu()

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        return self.scores(completions).tolist()


class ClipScoreReward(_ClipReward):
    """Image-caption agreement of a CLIP model; the caption is the prompt.

    ``kind="clip_score"`` (default): CLIPScore of Hessel et al. 2021, ``w * max(cos(img, txt), 0)`` with
    ``w = 2.5``. ``kind="cosine"``: the raw cosine times ``scale`` (default 1; 100 gives the "x100"
    convention of some repos). Prompts that are chat messages use their text content.

    Args:
        model_name, pretrained: open_clip model and tag or local checkpoint (default ViT-B-32 / openai);
        kind, w, scale: see above.  device, batch_size, clip: as ``AestheticReward``.
    """

    name = "clip_score"

    def __init__(self, model_name: str = "ViT-B-32", pretrained: str = "openai", kind: str = "clip_score",
                 w: float = 2.5, scale: float = 1.0, device: str | torch.device | None = None,
                 batch_size: int = 32, clip: Any = None) -> None:
        if kind not in ("clip_score", "cosine"):
            raise ValueError(f"kind must be 'clip_score' or 'cosine', got {kind!r}")
        self.kind, self.w, self.scale = kind, w, scale
        if clip is not None:
            super().__init__(clip.model, clip.tokenize, clip.image_size, clip.mean, clip.std, device, batch_size)
            return
        import open_clip

        model, size, mean, std = _load_open_clip(model_name, pretrained, _resolve_device(device))
        super().__init__(model, open_clip.get_tokenizer(model_name), size, mean, std, device, batch_size)

    @torch.no_grad()
    def scores(self, prompts: list[Any], images: Any) -> Tensor:
        """float32 [B] on CPU."""
        from unialign.rewards.base import completion_to_text

        texts = [completion_to_text(p) for p in prompts]
        cos = (self.image_embeddings(images) * self.text_embeddings(texts)).sum(-1).float().cpu()
        return self.w * cos.clamp(min=0) if self.kind == "clip_score" else self.scale * cos

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        if prompts is None:
            raise TypeError("clip_score needs the prompts (the captions)")
        return self.scores(prompts, completions).tolist()


# ---------------------------------------------------------------------------------------------
# Human-preference rewards: PickScore (transformers CLIP) and HPSv2 (open_clip)
# ---------------------------------------------------------------------------------------------
PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
HPS_REPO = "xswu/HPSv2"
HPS_FILENAMES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


class _HFClip(nn.Module):
    """``encode_image`` / ``encode_text`` over a transformers ``CLIPModel`` (the ``_ClipReward`` interface).
    transformers 5 returns an output object from ``get_*_features`` (the projection in ``pooler_output``),
    4.x the tensor itself."""

    def __init__(self, model) -> None:
        super().__init__()
        self.clip = model

    @staticmethod
    def _tensor(out) -> Tensor:
        return out if isinstance(out, Tensor) else out.pooler_output

    def encode_image(self, pixel_values: Tensor) -> Tensor:
        """[B, 3, S, S] -> [B, D] (unnormalised)"""
        return self._tensor(self.clip.get_image_features(pixel_values=pixel_values))

    def encode_text(self, batch) -> Tensor:
        """tokenizer output (input_ids, attention_mask) -> [B, D] (unnormalised)"""
        return self._tensor(self.clip.get_text_features(input_ids=batch["input_ids"],
                                                        attention_mask=batch.get("attention_mask")))


def _clip_image_processor_pil(path: str):
    """The PIL ("slow") CLIP image processor of ``path``: what PickScore's published code ran (transformers 4,
    ``AutoProcessor``); transformers 5 defaults to a torchvision backend whose resize differs per pixel."""
    try:
        from transformers import CLIPImageProcessorPil as processor_class  # transformers >= 5
    except ImportError:
        from transformers import CLIPImageProcessor as processor_class  # transformers 4: PIL-based
    return processor_class.from_pretrained(path)


class PickScoreReward(_ClipReward):
    """PickScore (Kirstain et al. 2023): a CLIP-H/14 fine-tuned on Pick-a-Pic human preferences; the caption
    is the prompt. Score = ``logit_scale.exp() * cos(text, image) / divisor`` with image i paired with
    prompt i (≈ 18..24 for real images with the published weights; Flow-GRPO uses ``divisor=26``).

    Published preprocessing, as the PickScore README: ``AutoProcessor`` of
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (images: shortest side to 224 with PIL bicubic, center crop
    224, /255, CLIP mean/std -- the PIL processor is pinned, see ``_clip_image_processor_pil``; text:
    ``padding=True, truncation=True, max_length=77``), embeddings L2-normalised, float32.

    Args:
        model: Hub id or local directory of the transformers ``CLIPModel`` (default ``PICKSCORE_MODEL``);
            loaded with ``from_pretrained`` (safetensors, else ``weights_only`` torch loading), eval, no grad.
        processor: Hub id or local directory of the processor (tokenizer + image processor config); default
            ``PICKSCORE_PROCESSOR`` as in the README (the model repo's own processor files differ in nothing
            that matters, but the published code names this one).
        divisor: the score is divided by it (1 = the published score).  device, batch_size: as
            ``AestheticReward``.
    Offline without cached weights: ``HubUnavailableError`` (a RuntimeError) within seconds, before loading.
    """

    name = "pickscore"

    def __init__(self, model: str = PICKSCORE_MODEL, processor: str = PICKSCORE_PROCESSOR, divisor: float = 1.0,
                 device: str | torch.device | None = None, batch_size: int = 32) -> None:
        from transformers import AutoTokenizer, CLIPModel

        from unialign.hub import require_hub

        require_hub(model)  # both checked before anything loads (fail fast)
        require_hub(processor)
        self.divisor = float(divisor)
        self.image_processor = _clip_image_processor_pil(processor)
        self.tokenizer = AutoTokenizer.from_pretrained(processor)
        clip = CLIPModel.from_pretrained(model).eval().requires_grad_(False)
        self.logit_scale = float(clip.logit_scale.detach().float().exp())
        crop = self.image_processor.crop_size  # a dict (transformers 4) or a SizeDict (5); only recorded here
        size = int(crop if isinstance(crop, int) else getattr(crop, "height", None) or crop["height"])
        super().__init__(_HFClip(clip), self._tokenize_texts, size, self.image_processor.image_mean,
                         self.image_processor.image_std, device, batch_size)

    def _tokenize_texts(self, texts: list[str]):
        return self.tokenizer(list(texts), padding=True, truncation=True, max_length=77, return_tensors="pt")

    def preprocess(self, images: Any) -> Tensor:
        """The processor's pixel values [B, 3, S, S] float32 on CPU (class docstring)."""
        pixels = self.image_processor(images=to_pil_images(images), return_tensors="pt")["pixel_values"]
        return pixels.float()

    @torch.no_grad()
    def scores(self, prompts: list[Any], images: Any) -> Tensor:
        """float32 [B] on CPU: image i scored against prompt i."""
        from unialign.rewards.base import completion_to_text

        texts, pils = [completion_to_text(p) for p in prompts], to_pil_images(images)
        if len(texts) != len(pils):
            raise ValueError(f"pickscore: {len(texts)} prompts for {len(pils)} images")
        cos = (self.image_embeddings(pils) * self.text_embeddings(texts)).sum(-1).float().cpu()
        return self.logit_scale * cos / self.divisor

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        if prompts is None:
            raise TypeError("pickscore needs the prompts (the captions)")
        return self.scores(prompts, completions).tolist()


def _hps_checkpoint_file(checkpoint: str, version: str) -> str:
    """A local HPS checkpoint file from a file, a directory holding ``HPS_FILENAMES[version]``, or a Hub id
    (checked with ``require_hub`` first, then downloaded with ``hf_hub_download``)."""
    if version not in HPS_FILENAMES:
        raise ValueError(f"hps version must be one of {sorted(HPS_FILENAMES)}, got {version!r}")
    path = Path(checkpoint).expanduser()
    if path.is_file():
        return str(path)
    if path.is_dir():
        file = path / HPS_FILENAMES[version]
        if not file.is_file():
            raise FileNotFoundError(f"hps: {path} holds no {HPS_FILENAMES[version]} (version {version})")
        return str(file)
    from unialign.hub import require_hub

    require_hub(checkpoint)
    from huggingface_hub import hf_hub_download

    return hf_hub_download(checkpoint, HPS_FILENAMES[version])


class HpsReward(_ClipReward):
    """HPSv2 / HPSv2.1 (Wu et al. 2023): open_clip ViT-H-14 fine-tuned on human preference pairs; the caption
    is the prompt. Score = ``cos(image, text)`` with image i paired with prompt i (≈ 0.2..0.35 for real
    images), as HPSv2's ``img_score.score``: ``diag(image_features @ text_features.T)`` of the model's
    normalised features.

    Published preprocessing: HPSv2's ``preprocess_val`` (open_clip's eval transform: shortest side to 224 with
    bicubic, center crop, CLIP mean/std) = the pinned ``clip_preprocess``; text: open_clip's tokenizer of
    the architecture (context 77). Computed in float32 (HPSv2 runs CUDA autocast).

    Args:
        checkpoint: a Hub id (default ``HPS_REPO``), a local directory holding ``HPS_FILENAMES[version]``, or
            a local checkpoint file (``{"state_dict": ...}`` or a bare state dict), loaded with
            ``torch.load(..., weights_only=True)`` into the architecture, strictly.
        version: "v2.1" (default; DanceGRPO's and Flow-GRPO's) or "v2.0" (the ``hpsv2`` package default).
        model_name: the open_clip architecture (default ViT-H-14), or a path to an open_clip model config
            ``.json`` (registered under its file stem). No pretrained CLIP weights are fetched: the
            checkpoint holds every parameter.
        device, batch_size: as ``AestheticReward``.
    Offline without cached weights: ``HubUnavailableError`` (a RuntimeError) within seconds, before loading.
    """

    name = "hps"

    def __init__(self, checkpoint: str = HPS_REPO, version: str = "v2.1", model_name: str = "ViT-H-14",
                 device: str | torch.device | None = None, batch_size: int = 32) -> None:
        import open_clip

        file = _hps_checkpoint_file(checkpoint, version)  # fails fast offline, before building ViT-H
        if model_name.endswith(".json"):
            open_clip.add_model_config(model_name)
            model_name = Path(model_name).stem
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:  # weights_only refuses anything but tensors and plain containers
            raise ValueError(f"hps: {file} is not a plain state dict; refusing to unpickle it ({err})") from None
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        model = open_clip.create_model(model_name, pretrained=None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"hps: checkpoint {file} does not fit open_clip {model_name!r}: missing keys "
                             f"{list(missing)[:5]}, unexpected keys {list(unexpected)[:5]}")
        size, mean, std = open_clip_preprocess(model, f"hps: {model_name}", "HPSv2's is shortest-side bicubic resize "
                                               "+ center crop")
        super().__init__(model.eval().requires_grad_(False), open_clip.get_tokenizer(model_name), size, mean, std,
                         device, batch_size)

    @torch.no_grad()
    def scores(self, prompts: list[Any], images: Any) -> Tensor:
        """float32 [B] on CPU: image i scored against prompt i."""
        from unialign.rewards.base import completion_to_text

        texts, pils = [completion_to_text(p) for p in prompts], to_pil_images(images)
        if len(texts) != len(pils):
            raise ValueError(f"hps: {len(texts)} prompts for {len(pils)} images")
        return (self.image_embeddings(pils) * self.text_embeddings(texts)).sum(-1).float().cpu()

    def __call__(self, prompts: list[Any] | None = None, completions: Any = None, **_: Any) -> list[float]:
        if prompts is None:
            raise TypeError("hps needs the prompts (the captions)")
        return self.scores(prompts, completions).tolist()
