"""How the shipped tiny video VLM (``unialign/embedded/assets/vlm_video``) is built: the embedded image VLM
(``unialign/embedded/assets/vlm``, ``tools/build_vlm.py``) extended to the motion world's clips
(``unialign.embedded.vlm_video``; why the label noise: that module's docstring).

CLI (from the repository root)::

    python -m tools.build_vlm_video build --out DIR   # deterministic rebuild (same machine / torch / threads)
    python -m tools.build_vlm_video eval [--path DIR] # held-out greedy accuracy per question type, pass@8
    python -m tools.build_vlm_video check [--keep DIR]  # build into a temp folder, compare with the shipped one

Stage 0: the tokenizer gains ``VIDEO_WORDS`` (single tokens); a fresh model of the image VLM's sizes takes every
weight of the shipped image VLM, the token embeddings row by row by token string (the new words keep their fresh
initialisation). Stage 1 (``pretrain_vision``): the vision tower alone as a classifier of the clip's four attributes
(shape, colour, background, direction) on fresh training clips: temporary linear heads on the mean of the clip's
merged tokens (Qwen2-VL's 3-D patches pair consecutive frames, so a patch sees the motion between them). Stage 2:
the tower frozen, the language model on fresh training clips, one question per clip (the four types equally likely),
answers in ``vlm_video.CONFUSIONS`` replaced by their partner with probability ``confusion_rate``. Loss: next-token
cross-entropy on the answer word and ``<|im_end|>``. AdamW, linear warm-up, cosine decay to 0, a fixed number of
steps, one thread, deterministic algorithms. Clips are drawn only from the training prompts.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tools import asset_check
from tools.asset_check import Comparison, rebuild_from_record
from tools.build_vlm import collate, qa_metrics
from unialign.embedded import motion_world, vlm, vlm_video

DEFAULT_STEPS = 800
DEFAULT_BATCH = 64
DEFAULT_LR = 1e-3
DEFAULT_CONFUSION_RATE = 0.8
DEFAULT_VISION_STEPS = 800
DEFAULT_VISION_LR = 1e-3
DEFAULT_DIRECTION_WEIGHT = 3.0
BUILT_FILES = ("build_metrics.json", "chat_template.jinja", "config.json", "generation_config.json",
               "model.safetensors", "processor_config.json", "tokenizer.json", "tokenizer_config.json")
TIMING_FIELDS = ("vision_seconds", "train_seconds", "eval_seconds")
RECORD_KEYS = ("seed", "steps", "batch_size", "lr", "warmup", "num_threads", "confusion_rate", "vision_steps",
               "vision_lr", "direction_weight")


def extend_image_vlm(source: str | Path, seed: int = 0):
    """Stage 0 (module docstring): (model, processor) of the image VLM at ``source`` with ``VIDEO_WORDS`` added."""
    old_tok = vlm.build_tokenizer()
    tok = vlm_video.build_tokenizer()
    processor = vlm.build_processor(tok)
    model = vlm.build_model(tok, seed=seed, **vlm.MODEL_DEFAULTS)
    old = vlm.load_embedded_vlm(source)[0].state_dict()
    new = model.state_dict()
    emb_key = next(k for k in new if k.endswith("embed_tokens.weight"))
    if set(old) - {emb_key, "lm_head.weight"} != set(new) - {emb_key, "lm_head.weight"}:
        raise ValueError(f"{source}: not an image VLM of this project's sizes (its weights differ by name)")
    rows = new[emb_key].clone()
    new_vocab = tok.get_vocab()
    for token, old_id in old_tok.get_vocab().items():
        rows[new_vocab[token]] = old[emb_key][old_id]
    state = {k: (rows if k == emb_key else old[k]) for k in new if k != "lm_head.weight"}
    model.load_state_dict(state, strict=False)  # lm_head is tied to the embeddings
    return model, processor


def _attributes(prompt: str) -> list[int]:
    parts = vlm_video.parts_of(prompt)
    return [vlm_video.SHAPES.index(parts["shape"]), vlm.COLOURS.index(parts["colour"]),
            vlm.COLOURS.index(parts["background"]), vlm_video.DIRECTIONS.index(parts["direction"])]


def random_clip(prompt: str, rng: random.Random) -> list:
    shape, colour, background, direction = motion_world.parse_motion_prompt(prompt)
    return motion_world.render_clip(shape, colour, background, direction, rng)


def pretrain_vision(model, processor, prompts: list[str], steps: int, lr: float, rng: random.Random,
                    batch_size: int, direction_weight: float, warmup: int = 25, log_every: int = 50,
                    verbose: bool = True, t0: float | None = None) -> float:
    """Stage 1: the vision tower (and merger) alone as a classifier of (shape, colour, background, direction) on the
    mean of each clip's merged tokens; the sum of the four cross-entropies, the direction's weighted
    ``direction_weight`` (the new skill). Returns the last loss."""
    visual = model.model.visual
    width = model.config.text_config.hidden_size
    sizes = (len(vlm_video.SHAPES), len(vlm.COLOURS), len(vlm.COLOURS), len(vlm_video.DIRECTIONS))
    heads = torch.nn.ModuleList([torch.nn.Linear(width, n) for n in sizes])
    weights = (1.0, 1.0, 1.0, direction_weight)
    params = list(visual.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    t0 = time.time() if t0 is None else t0
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        chosen = [rng.choice(prompts) for _ in range(batch_size)]
        enc = processor.video_processor([random_clip(p, rng) for p in chosen], return_tensors="pt")
        grid = enc["video_grid_thw"]
        feats = visual(enc["pixel_values_videos"], grid_thw=grid)
        feats = getattr(feats, "pooler_output", feats)
        per_clip = int(grid[0].prod()) // vlm.MERGE_SIZE**2
        feats = feats.view(batch_size, per_clip, -1).mean(1)
        targets = torch.tensor([_attributes(p) for p in chosen])
        losses = [torch.nn.functional.cross_entropy(h(feats), targets[:, i]) for i, h in enumerate(heads)]
        loss = sum(w * x for w, x in zip(weights, losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if verbose and (step % log_every == 0 or step == steps - 1):
            print(f"vision step {step:4d}  loss " + " ".join(f"{n} {x.item():.3f}" for n, x in
                                                           zip(("shape", "colour", "background", "direction"), losses))
                  + f"  {time.time() - t0:.0f}s", flush=True)
    return float(loss.detach())


def draw_example(rng: random.Random, prompts: list[str], confusion_rate: float) -> tuple[list, str, str]:
    """(clip, question, target word) of the stage-2 stream (module docstring)."""
    prompt = rng.choice(prompts)
    clip = random_clip(prompt, rng)
    qt = rng.choice(vlm_video.QA_TYPES)
    answer = vlm_video.parts_of(prompt)[qt]
    if answer in vlm_video.CONFUSIONS and rng.random() < confusion_rate:
        answer = vlm_video.CONFUSIONS[answer]
    return clip, vlm_video.QUESTIONS[qt], answer


def evaluate(model, processor, n_rows: int | None = None, k: int = 8, seed: int = 0) -> dict[str, Any]:
    """Held-out numbers (``build_vlm.qa_metrics``): greedy accuracy (all, per question type, on the confused words and
    the others), the answers' form, pass@k and per-sample accuracy at temperature 1."""
    rows = vlm_video.video_dataset("test", n=n_rows)
    return qa_metrics(model, processor, rows, vlm_video.QA_TYPES, vlm_video.CONFUSIONS, k, seed)


def build(out_dir: str | Path, seed: int = 0, steps: int = DEFAULT_STEPS, batch_size: int = DEFAULT_BATCH,
          lr: float = DEFAULT_LR, warmup: int = 25, num_threads: int = 1, confusion_rate: float = DEFAULT_CONFUSION_RATE,
          vision_steps: int = DEFAULT_VISION_STEPS, vision_lr: float = DEFAULT_VISION_LR,
          direction_weight: float = DEFAULT_DIRECTION_WEIGHT, source: str | Path = vlm.VLM_DIR,
          eval_rows: int | None = 0, log_every: int = 50, verbose: bool = True) -> dict[str, Any]:
    """Stages 0-2 (module docstring) for FIXED step counts from the image VLM at ``source``; saves model and
    processor to ``out_dir`` with ``build_metrics.json`` (arguments, timings and, unless ``eval_rows`` is None, the
    held-out evaluation: 0 means every held-out row). Deterministic for a given ``seed`` on one machine / torch."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with asset_check.deterministic(num_threads):
        model, processor = extend_image_vlm(source, seed)
        prompts = motion_world.prompts("train")
        rng = random.Random(f"vlm-video-build-{seed}")
        model.train()
        vision_loss = pretrain_vision(model, processor, prompts, vision_steps, vision_lr, rng, batch_size,
                                      direction_weight, log_every=log_every, verbose=verbose, t0=t0) \
            if vision_steps else None
        vision_s = time.time() - t0
        visual_ids = {id(p) for p in model.model.visual.parameters()}
        params = [p for p in model.parameters() if id(p) not in visual_ids]  # the tower frozen
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

        def lr_at(s: int) -> float:
            if s < warmup:
                return lr * (s + 1) / warmup
            return lr * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

        for step in range(steps):
            batch = collate(processor, [draw_example(rng, prompts, confusion_rate) for _ in range(batch_size)], "video")
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if verbose and (step % log_every == 0 or step == steps - 1):
                print(f"step {step:4d}  loss {loss.item():.4f}  lr {lr_at(step):.2e}  {time.time() - t0:.0f}s",
                      flush=True)
        train_s = time.time() - t0
        model.eval()
        model.save_pretrained(str(out), safe_serialization=True)
        processor.save_pretrained(str(out))
        metrics: dict[str, Any] = {
            "seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "warmup": warmup,
            "num_threads": num_threads, "confusion_rate": confusion_rate, "vision_steps": vision_steps,
            "vision_lr": vision_lr, "direction_weight": direction_weight,
            "vision_final_loss": None if vision_loss is None else round(vision_loss, 4),
            "source_sha256": asset_check.sha256(Path(source) / "model.safetensors"),
            "parameters": sum(p.numel() for p in model.parameters()),
            "vision_seconds": round(vision_s, 1), "train_seconds": round(train_s, 1), "torch": torch.__version__,
        }
        if eval_rows is not None:
            t1 = time.time()
            metrics["eval"] = evaluate(model, processor, n_rows=eval_rows or None)
            metrics["eval_seconds"] = round(time.time() - t1, 1)
        return asset_check.write_metrics(out, metrics, verbose)


def check(shipped: str | Path = vlm_video.VLM_VIDEO_DIR, keep: str | Path | None = None, **build_kw: Any) -> Comparison:
    """Rebuild with the shipped record's arguments into a temp folder (``keep``: this folder, left in place) and
    compare every file ``build`` writes with the shipped one (sha256; ``build_metrics.json`` without timings)."""
    return rebuild_from_record(build, shipped, RECORD_KEYS, BUILT_FILES, TIMING_FIELDS, keep, prefix="vlm_video_",
                               **build_kw)


def main(argv: list[str] | None = None) -> int:
    ap, sub, b = asset_check.builder_cli("python -m tools.build_vlm_video", __doc__, "extend the image VLM to clips "
                                         "deterministically and save it", vlm_video.VLM_VIDEO_DIR,
                                         (DEFAULT_STEPS, DEFAULT_BATCH, DEFAULT_LR))
    b.add_argument("--vision-steps", type=int, default=DEFAULT_VISION_STEPS)
    b.add_argument("--confusion-rate", type=float, default=DEFAULT_CONFUSION_RATE)
    b.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    e = sub.add_parser("eval", help="held-out greedy accuracy per question type, pass@k")
    e.add_argument("--path", default=None)
    e.add_argument("--n", type=int, default=None, help="held-out rows (default: all)")
    e.add_argument("--k", type=int, default=8)
    asset_check.add_check(sub, vlm_video.VLM_VIDEO_DIR)
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args.out, seed=args.seed, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
              num_threads=args.threads, confusion_rate=args.confusion_rate, vision_steps=args.vision_steps,
              eval_rows=None if args.no_eval else 0)
    elif args.command == "check":
        return asset_check.report_check(lambda: check(args.shipped, args.keep))
    else:
        model, processor = vlm_video.load_embedded_vlm_video(args.path)
        t0 = time.time()
        print(json.dumps({**evaluate(model, processor, n_rows=args.n, k=args.k), "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
