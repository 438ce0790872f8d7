"""``shape_reader``: a second, independent reading of prompt fidelity on the embedded shapes world.

The training reward of the image scripts is the shape verifier (``unialign.embedded.shape_verifier``: fixed pixel
rules). A policy can satisfy rules without drawing what a person would call the prompt (AWM / DiffusionNFT on the
embedded SD3 world drove it to 1.0 with darkened square corners and stepped triangles; reward-hacking studies of
2026, arXiv 2601.03468, find the same across image RL). This reader shares nothing with it: a small convolutional
classifier trained only on the world's own clean and mildly degraded renders (``tools.build_shape_reader``: a
deterministic build, shipped as ``assets/image/reader``), never on a model's samples or a reward. It reads the
three parts -- shape, object colour, background colour -- as three softmax heads (the shape head also knows "none",
an empty canvas), and an image passes a part only when the head names the prompt's value **with confidence at least
``CONFIDENCE``** (0.9): a blob, a shape between two templates or a colour between two palette entries is "unsure",
which fails. ``read`` returns each part's pass
rate and ``all`` (all three), the reading an image summary reports as ``fidelity_reader`` beside the verifier's.

The measured floors (``tools/build_shape_reader.py``'s record, re-checked by ``tests/rewards/test_shape_reader.py``):
on the clean renders of the held-out prompts it passes every part; on a held-out layout seed it reads the
verifier's own degradations as its BUILD record states.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unialign.embedded import shapes_world

PARTS = ("shape", "colour", "background")
SHAPE_CLASSES = (*shapes_world.SHAPES, "none")  # "none": trained on empty canvases, so a blank is not a "square"
CONFIDENCE = 0.9  # a part passes only when its head names the prompt's value with at least this probability
READER_DIR = shapes_world.DEFAULT_ASSET_DIR / "reader"


class ShapeReaderNet(nn.Module):
    """Three conv blocks (3 -> c -> 2c -> 2c, each conv 3x3 + ReLU, the first two followed by a 2x2 max pool) on a
    32 x 32 image in [0, 1], global average and max pooling, then one linear head per part (3 shapes and "none", 8
    colours, 8 backgrounds)."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        c = width
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU())
        n_colours = len(shapes_world.COLOURS)
        self.heads = nn.ModuleDict({"shape": nn.Linear(4 * c, len(SHAPE_CLASSES)),
                                    "colour": nn.Linear(4 * c, n_colours), "background": nn.Linear(4 * c, n_colours)})

    def forward(self, x_B_3_H_W: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.features(x_B_3_H_W * 2 - 1)
        pooled = torch.cat([h.mean(dim=(2, 3)), h.amax(dim=(2, 3))], dim=1)
        return {name: head(pooled) for name, head in self.heads.items()}


def labels(prompt: str) -> dict[str, int]:
    """The class index of each part named by a plain prompt of the world (ValueError for another prompt)."""
    from unialign.embedded.shape_verifier import parse_shape_prompt

    p = parse_shape_prompt(prompt)
    return {"shape": shapes_world.SHAPES.index(p.shape), "colour": list(shapes_world.COLOURS).index(p.colour),
            "background": list(shapes_world.COLOURS).index(p.background)}


class ShapeReader:
    """The shipped reader (or the one in ``path``), in eval mode on the CPU."""

    def __init__(self, path: str | Path | None = None) -> None:
        from safetensors.torch import load_file

        root = Path(path) if path is not None else READER_DIR
        config = json.loads((root / "config.json").read_text())
        # the layers' initialisation would draw from torch's global generator, which a training run is consuming
        # (a reader built at the first evaluation would shift every later draw, and a resumed run's): forked
        with torch.random.fork_rng(devices=[]):
            self.net = ShapeReaderNet(width=config["width"])
        self.net.load_state_dict(load_file(str(root / "model.safetensors")))
        self.net.eval().requires_grad_(False)
        self.confidence = float(config.get("confidence", CONFIDENCE))

    @torch.no_grad()
    def probabilities(self, images: Any) -> dict[str, torch.Tensor]:
        """Each head's softmax [B, classes] for PIL images / tensors of the world's size (resized to 32 x 32)."""
        x = shapes_world.to_tensor(images)
        if x.shape[-1] != shapes_world.IMAGE_SIZE or x.shape[-2] != shapes_world.IMAGE_SIZE:
            x = nn.functional.interpolate(x, size=(shapes_world.IMAGE_SIZE,) * 2, mode="area")
        return {k: v.softmax(-1) for k, v in self.net(x).items()}

    def read(self, prompts: list[str], images: Any, **_columns: Any) -> dict[str, torch.Tensor]:
        """Per image [N] float 0 / 1: each part passed (the prompt's value at >= ``confidence``) and ``all``."""
        probs = self.probabilities(images)
        want = [labels(p) for p in prompts]
        out = {}
        for part in PARTS:
            idx = torch.tensor([w[part] for w in want])
            out[part] = (probs[part].gather(1, idx[:, None]).squeeze(1) >= self.confidence).float()
        out["all"] = out["shape"] * out["colour"] * out["background"]
        return out


_READER: ShapeReader | None = None


def shipped_reader() -> ShapeReader:
    """The shipped reader, loaded once per process."""
    global _READER
    if _READER is None:
        _READER = ShapeReader()
    return _READER
