"""How the shapes world's second fidelity reader (``unialign.embedded.shape_reader``, shipped in
``unialign/embedded/assets/image/reader``) is built: a small CNN trained only on the world's renders -- every
prompt's clean images in random layouts, half of them blurred or noised a little, and in every batch a few empty
canvases of a background colour (shape "none", no object colour) -- with one head per part. It never
sees a model's sample or a reward, so it reads a policy's images independently of the shape verifier the policy
was trained on.

CLI (from the repository root)::

    python -m tools.build_shape_reader build --out DIR     # deterministic build (the shipped: assets/image/reader)
    python -m tools.build_shape_reader check               # rebuild into a temp folder, compare (sha256)

The record (``build_metrics.json``) holds the reader's pass rates at its confidence on renders of another layout
seed: clean, and under each of the verifier's degradations at strength 0.5. About 40 s on one thread.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tools.asset_check import (
    add_check,
    builder_cli,
    deterministic,
    rebuild_and_compare,
    report_check,
    write_metrics,
)
from unialign.embedded import shapes_world
from unialign.embedded.shape_reader import (
    CONFIDENCE,
    PARTS,
    READER_DIR,
    SHAPE_CLASSES,
    ShapeReader,
    ShapeReaderNet,
    labels,
)

BUILT_FILES = ("model.safetensors", "config.json", "build_metrics.json")
TIMING_FIELDS = ("train_seconds",)
MILD = ("blurry", "noisy")  # what a decoder's softness looks like; faded / dark change the colours the prompt names
BLANKS = 8  # empty canvases per batch (shape "none"; their object colour is not trained: ignored by the loss)
IGNORE = -100


def _data(seed: int, per_prompt: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    data = shapes_world.shape_dataset("all", per_prompt=per_prompt, seed=seed)
    x = shapes_world.to_tensor([d.image for d in data])
    y = [labels(d.prompt) for d in data]
    return x, {part: torch.tensor([row[part] for row in y]) for part in PARTS}


def _augment(x: torch.Tensor, rng: random.Random, generator: torch.Generator) -> torch.Tensor:
    """Half the batch blurred or noised at a strength in [0, 0.5] (one kind per image)."""
    out = x.clone()
    for i in range(len(x)):
        if rng.random() < 0.5:
            kind = rng.choice(MILD)
            out[i:i + 1] = shapes_world.degrade(x[i:i + 1], kind, torch.tensor([rng.uniform(0.0, 0.5)]), generator)
    return out


def train(seed: int = 0, steps: int = 3000, batch_size: int = 128, lr: float = 3e-3, per_prompt: int = 24,
          width: int = 24) -> ShapeReaderNet:
    torch.manual_seed(seed)
    net = ShapeReaderNet(width=width)
    x, y = _data(seed, per_prompt)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    order = torch.Generator().manual_seed(seed + 1)
    colours = list(shapes_world.COLOURS.values())
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch_size,), generator=order)
        bg = torch.randint(0, len(colours), (BLANKS,), generator=order)
        blank = torch.tensor([colours[i] for i in bg.tolist()], dtype=torch.float32).view(-1, 3, 1, 1) / 255.0
        xb = torch.cat([x[idx], blank.expand(-1, -1, *x.shape[2:])])
        target = {p: y[p][idx] for p in PARTS}
        target = {"shape": torch.cat([target["shape"], torch.full((BLANKS,), SHAPE_CLASSES.index("none"))]),
                  "colour": torch.cat([target["colour"], torch.full((BLANKS,), IGNORE)]),
                  "background": torch.cat([target["background"], bg])}
        logits = net(_augment(xb, rng, generator))
        loss = sum(F.cross_entropy(logits[p], target[p], ignore_index=IGNORE) for p in PARTS)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return net.eval()


def measure(reader: ShapeReader, seed: int, per_prompt: int = 4) -> dict[str, Any]:
    """Pass rates (``all`` and each part) on renders of layout seed ``seed``: clean and under each degradation at
    strength 0.5."""
    data = shapes_world.shape_dataset("all", per_prompt=per_prompt, seed=seed)
    x, prompts = shapes_world.to_tensor([d.image for d in data]), [d.prompt for d in data]
    out = {}
    generator = torch.Generator().manual_seed(seed)
    for kind in ("clean", *shapes_world.DEGRADATIONS):
        xs = x if kind == "clean" else shapes_world.degrade(x, kind, torch.full((len(x),), 0.5), generator)
        reading = reader.read(prompts, xs)
        out[kind] = {k: round(float(v.mean()), 4) for k, v in reading.items()}
    return out


def build(out: str | Path, seed: int = 0, steps: int = 3000, batch_size: int = 128, lr: float = 3e-3,
          threads: int = 1, per_prompt: int = 24, width: int = 24, verbose: bool = True) -> dict[str, Any]:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with deterministic(threads):
        t0 = time.perf_counter()
        net = train(seed, steps, batch_size, lr, per_prompt, width)
        seconds = time.perf_counter() - t0
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"width": width, "confidence": CONFIDENCE, "parts": list(PARTS)},
                                                indent=2) + "\n")
    metrics = dict(seed=seed, steps=steps, batch_size=batch_size, lr=lr, threads=threads, per_prompt=per_prompt,
                   width=width, parameters=sum(p.numel() for p in net.parameters()), train_seconds=round(seconds, 1),
                   held_out_layouts=measure(ShapeReader(out), seed + 1000))
    return write_metrics(out, metrics, verbose)


def check(shipped: str | Path = READER_DIR, keep: str | Path | None = None):
    record = json.loads((Path(shipped) / "build_metrics.json").read_text())
    kw = {k: record[k] for k in ("seed", "steps", "batch_size", "lr", "threads", "per_prompt", "width")}
    return rebuild_and_compare(build, dict(kw, verbose=False), shipped, BUILT_FILES, TIMING_FIELDS, keep,
                               prefix="reader_")


def main(argv: list[str] | None = None) -> int:
    parser, sub, b = builder_cli("python -m tools.build_shape_reader", __doc__, "train the reader deterministically",
                                 READER_DIR, training=(3000, 128, 3e-3))
    add_check(sub, READER_DIR)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out, args.seed, args.steps, args.batch_size, args.lr, args.threads)
        return 0
    return report_check(lambda: check(args.shipped, args.keep))


if __name__ == "__main__":
    sys.exit(main())
