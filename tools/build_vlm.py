"""How the shipped tiny VLM (``unialign/embedded/assets/vlm``) is built: the tokenizer, processor and tiny
Qwen2-VL of ``unialign.embedded.vlm``, their supervised warm start with confusion label noise (why: that module's
docstring), its evaluation, and the check that a rebuild gives the shipped files.

CLI (from the repository root)::

    python -m tools.build_vlm build --out DIR   # deterministic rebuild (same machine / torch / threads)
    python -m tools.build_vlm eval [--path DIR] # held-out QA greedy accuracy per type, pass@8, judge accuracy
    python -m tools.build_vlm check [--keep DIR]  # build into a temp folder, compare with the shipped one

Stage 1 (``pretrain_vision``): the vision tower alone as a classifier of the three attributes. Stage 2: the tower
frozen (``vision_lr_scale`` 0: its parameter group's learning rate is 0, so its weights do not move, though its
gradients are still computed and count in the clipping norm; the shipped build was made this way), the language
model on the training stream. Training stream: every step draws ``batch_size`` fresh examples from the training captions only (a random layout
per image, ``vlm.random_layout``), each a QA question (colour / shape / background, equally likely) or, with
probability ``judge_share``, the judge question on the image's own caption (yes) or on a caption differing in one
attribute (no), half and half. With probability ``augment`` the image is degraded first (``shapes_world.degrade``
"blurry" or "noisy" at strength U(0.3, 1); attributes stay readable), so that the judge also reads the blurrier
images of the shapes world's diffusion models. QA targets whose true answer is in ``vlm.CONFUSIONS`` become the
partner word with probability ``confusion_rate`` (the label noise; judge targets are always true). Loss: next-token
cross-entropy on the answer word and ``<|im_end|>`` only. AdamW, linear warmup, cosine decay to 0, a fixed number
of steps, one thread, deterministic algorithms.
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
from tools.asset_check import Comparison, rebuild_and_compare
from unialign.embedded import shapes_world, vlm

DEFAULT_STEPS = 1000
DEFAULT_BATCH = 64
DEFAULT_LR = 1.5e-3
DEFAULT_CONFUSION_RATE = 0.8
DEFAULT_JUDGE_SHARE = 0.15
DEFAULT_AUGMENT = 0.3
DEFAULT_HARD_NEGATIVES = 0.5
DEFAULT_VISION_STEPS = 1500
DEFAULT_VISION_LR = 1e-3
DEFAULT_VISION_LR_SCALE = 0.0
DEFAULT_SHAPE_WEIGHT = 3.0
# what `build` writes (BUILD.md beside them is written by hand); build_metrics.json carries the wall times
BUILT_FILES = ("build_metrics.json", "chat_template.jinja", "config.json", "generation_config.json",
               "model.safetensors", "processor_config.json", "tokenizer.json", "tokenizer_config.json")
TIMING_FIELDS = ("vision_seconds", "train_seconds", "eval_seconds")


def _to_pil(x_3_H_W: torch.Tensor):
    from PIL import Image

    return Image.fromarray((x_3_H_W.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy())


def draw_example(rng: random.Random, gen: torch.Generator, captions: list[str], confusion_rate: float,
                 judge_share: float, augment: float, hard_negatives: float = 0.5,
                 allowed: set[str] | None = None) -> list[tuple[Any, str, str]]:
    """One image's training examples (image, question, target word) of the stream (module docstring): one QA
    question, or the judge's positive and negative on the same image (the only difference in the pair is the
    caption, which is what the judge must read). Judge negatives are
    training captions only (``allowed``, default ``captions``): a held-out caption's text never appears in
    training, not even as a "no"."""
    allowed = set(captions) if allowed is None else allowed
    cap = rng.choice(captions)
    image = vlm.render_caption(cap, vlm.random_layout(rng))
    if rng.random() < augment:
        kind = rng.choice(("blurry", "noisy"))
        strength = torch.tensor([rng.uniform(0.3, 1.0)])
        image = _to_pil(shapes_world.degrade(shapes_world.to_tensor([image]), kind, strength, gen)[0])
    if rng.random() < judge_share:  # a pair: the image's own caption (yes) and another one (no)
        if rng.random() < hard_negatives:
            negative = vlm.judge_negative(cap, rng, allowed)
        else:
            negative = rng.choice([c for c in captions if c != cap])
        return [(image, vlm.judge_question(cap), vlm.YES), (image, vlm.judge_question(negative), vlm.NO)]
    qt = rng.choice(vlm.QA_TYPES)
    answer = vlm.answer_for(qt, *vlm._caption_parts(cap))
    if answer in vlm.CONFUSIONS and rng.random() < confusion_rate:
        answer = vlm.CONFUSIONS[answer]
    return [(image, vlm.QUESTIONS[qt], answer)]


def collate(processor, examples: list[tuple[Any, str, str]], media: str = "image") -> dict[str, torch.Tensor]:
    """Left-padded processor inputs of prompt + target + ``<|im_end|>``, labels on the target and ``<|im_end|>``.
    ``examples``: (image, question, target word), or (video frames, question, target word) with ``media="video"``."""
    tok = processor.tokenizer
    texts = [vlm.chat_prompt(processor, q, media) + a + vlm.EOS for _, q, a in examples]
    tok.padding_side = "left"
    visuals = {"images" if media == "image" else "videos": [v for v, _, _ in examples]}
    enc = processor(text=texts, **visuals, padding=True, return_tensors="pt")
    labels = torch.full_like(enc["input_ids"], -100)
    for i, (_, _, a) in enumerate(examples):
        n = len(tok.encode(a + vlm.EOS, add_special_tokens=False))
        labels[i, -n:] = enc["input_ids"][i, -n:]
    enc["labels"] = labels
    return dict(enc)


def pretrain_vision(model, processor, captions: list[str], steps: int, lr: float, rng: random.Random,
                    batch_size: int = 64, warmup: int = 50, log_every: int = 100, verbose: bool = True,
                    t0: float | None = None, shape_weight: float = 1.0) -> float:
    """Stage 1: the vision tower (and its merger) alone, as a classifier of the three attributes: temporary linear
    heads (shape, object colour, background colour) on the mean of the image's merged tokens (what the language
    model reads), the sum of their cross-entropies on fresh training renders. Returns the last loss. (Why a stage
    of its own: trained only through the language model, the colours were learned in a few dozen steps and the
    shape stayed at chance for 800; trained on the shape alone, the tower's tokens lost the colours, which the
    language model then could not read.)"""
    visual = model.model.visual
    width = model.config.text_config.hidden_size
    heads = torch.nn.ModuleList([torch.nn.Linear(width, len(vlm.SHAPES)), torch.nn.Linear(width, len(vlm.COLOURS)),
                                 torch.nn.Linear(width, len(vlm.COLOURS))])
    params = list(visual.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    t0 = time.time() if t0 is None else t0
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        caps = [rng.choice(captions) for _ in range(batch_size)]
        pix = processor.image_processor([vlm.render_caption(c, vlm.random_layout(rng)) for c in caps],
                                        return_tensors="pt")
        parts = [vlm._caption_parts(c) for c in caps]
        targets = [torch.tensor([vlm.SHAPES.index(s) for s, _, _ in parts]),
                   torch.tensor([vlm.COLOURS.index(c) for _, c, _ in parts]),
                   torch.tensor([vlm.COLOURS.index(b) for _, _, b in parts])]
        feats = visual(pix["pixel_values"], grid_thw=pix["image_grid_thw"])
        feats = getattr(feats, "pooler_output", feats).view(batch_size, vlm.IMAGE_TOKENS, -1).mean(1)
        losses = [torch.nn.functional.cross_entropy(h(feats), t) for h, t in zip(heads, targets)]
        loss = shape_weight * losses[0] + losses[1] + losses[2]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if verbose and (step % log_every == 0 or step == steps - 1):
            print(f"vision step {step:5d}  loss shape {losses[0].item():.4f} colour {losses[1].item():.4f} "
                  f"background {losses[2].item():.4f}  {time.time() - t0:.0f}s", flush=True)
    return loss.item()


def qa_metrics(model, processor, rows: list[dict[str, Any]], question_types: tuple[str, ...],
               confusions: dict[str, str], k: int = 8, seed: int = 0) -> dict[str, Any]:
    """Greedy accuracy on ``rows`` (all, per question type, on the words of ``confusions`` and the others), the
    greedy answers' form (one word), pass@k and per-sample accuracy at temperature 1 (``vlm.generate_answers``)."""
    greedy = [c[0] for c in vlm.generate_answers(model, processor, rows)]
    correct = [vlm.is_correct(c, r["solution"]) for c, r in zip(greedy, rows)]
    out: dict[str, Any] = {"qa_rows": len(rows), "greedy_acc": round(sum(correct) / len(rows), 4)}
    for qt in question_types:
        sel = [ok for ok, r in zip(correct, rows) if r["question_type"] == qt]
        out[f"greedy_acc_{qt}"] = round(sum(sel) / max(1, len(sel)), 4)
    out["greedy_well_formed"] = round(sum(vlm.parse_answer(c) is not None for c in greedy) / len(rows), 4)
    confused = [ok for ok, r in zip(correct, rows) if r["solution"] in confusions]
    clean = [ok for ok, r in zip(correct, rows) if r["solution"] not in confusions]
    out["greedy_acc_confused_words"] = round(sum(confused) / max(1, len(confused)), 4)
    out["greedy_acc_other_words"] = round(sum(clean) / max(1, len(clean)), 4)
    samples = vlm.generate_answers(model, processor, rows, greedy=False, num_samples=k, seed=seed)
    out[f"pass_at_{k}"] = round(sum(any(vlm.is_correct(c, r["solution"]) for c in cs)
                                    for cs, r in zip(samples, rows)) / len(rows), 4)
    out["sample_acc"] = round(sum(vlm.is_correct(c, r["solution"]) for cs, r in zip(samples, rows) for c in cs)
                              / (k * len(rows)), 4)
    return out


def evaluate(model, processor, n_rows: int | None = None, k: int = 8, seed: int = 0) -> dict[str, Any]:
    """Held-out numbers: greedy QA accuracy (all and per question type), pass@k at temperature 1, judge accuracy
    (P(yes) > 0.5) and mean P(yes) on positive / negative judge rows, the greedy answers' form (one word)."""
    rows = vlm.vlm_dataset("test", n=n_rows)
    out = qa_metrics(model, processor, rows, vlm.QA_TYPES, vlm.CONFUSIONS, k, seed)
    judge = vlm.vlm_dataset("test", question_types=("judge",), seed=seed)
    judge = judge[:n_rows] if n_rows else judge
    p_yes = vlm.yes_probability(model, processor, [r["image"] for r in judge], [vlm._question(r) for r in judge])
    pos = [p for p, r in zip(p_yes, judge) if r["solution"] == vlm.YES]
    neg = [p for p, r in zip(p_yes, judge) if r["solution"] == vlm.NO]
    out["judge_rows"] = len(judge)
    out["judge_acc"] = round(sum((p > 0.5) == (r["solution"] == vlm.YES) for p, r in zip(p_yes, judge)) / len(judge), 4)
    out["judge_p_yes_positive"] = round(sum(pos) / max(1, len(pos)), 4)
    out["judge_p_yes_negative"] = round(sum(neg) / max(1, len(neg)), 4)
    out["judge_auc"] = round(sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / max(1, len(pos) * len(neg)), 4)
    return out


def build(out_dir: str | Path, seed: int = 0, steps: int = DEFAULT_STEPS, batch_size: int = DEFAULT_BATCH,
          lr: float = DEFAULT_LR, warmup: int = 50, num_threads: int = 1, confusion_rate: float = DEFAULT_CONFUSION_RATE,
          judge_share: float = DEFAULT_JUDGE_SHARE, augment: float = DEFAULT_AUGMENT,
          hard_negatives: float = DEFAULT_HARD_NEGATIVES, vision_steps: int = DEFAULT_VISION_STEPS, vision_lr: float = DEFAULT_VISION_LR,
          vision_lr_scale: float = DEFAULT_VISION_LR_SCALE, shape_weight: float = DEFAULT_SHAPE_WEIGHT, eval_rows: int | None = 0,
          log_every: int = 100, callback=None, verbose: bool = True, **model_kw: Any) -> dict[str, Any]:
    """Build tokenizer + processor, train the tiny Qwen2-VL on the training stream (module docstring) for a FIXED
    number of ``steps``, save model and processor to ``out_dir`` with ``build_metrics.json`` (arguments, timings
    and, unless ``eval_rows`` is None, the held-out evaluation: 0 means every held-out row). Deterministic for a
    given ``seed`` on one machine / torch build. ``callback(step, model, processor)`` every ``log_every`` steps."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with asset_check.deterministic(num_threads):
        tok = vlm.build_tokenizer()
        processor = vlm.build_processor(tok)
        model_args = {**vlm.MODEL_DEFAULTS, **model_kw}
        model = vlm.build_model(tok, seed=seed, **model_args)
        captions = vlm.split_captions("train")
        allowed = set(captions)
        rng, gen = random.Random(f"vlm-build-{seed}"), torch.Generator().manual_seed(seed)
        model.train()
        vision_loss = pretrain_vision(model, processor, captions, vision_steps, vision_lr, rng, batch_size=batch_size,
                                      log_every=log_every, verbose=verbose, t0=t0,
                                      shape_weight=shape_weight) if vision_steps else None
        vision_s = time.time() - t0
        visual = list(model.model.visual.parameters())
        visual_ids = {id(p) for p in visual}
        groups = [{"params": [p for p in model.parameters() if id(p) not in visual_ids], "scale": 1.0},
                  {"params": visual, "scale": vision_lr_scale}]
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

        def lr_at(s: int) -> float:
            if s < warmup:
                return lr * (s + 1) / warmup
            return lr * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

        for step in range(steps):
            examples: list[tuple[Any, str, str]] = []
            while len(examples) < batch_size:
                examples += draw_example(rng, gen, captions, confusion_rate, judge_share, augment, hard_negatives,
                                         allowed)
            batch = collate(processor, examples[:batch_size])
            for g in opt.param_groups:
                g["lr"] = lr_at(step) * g["scale"]
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if verbose and (step % log_every == 0 or step == steps - 1):
                print(f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step):.2e}  {time.time() - t0:.0f}s",
                      flush=True)
            if callback is not None and (step + 1) % log_every == 0:
                callback(step + 1, model, processor)
        train_s = time.time() - t0
        model.eval()
        model.save_pretrained(str(out), safe_serialization=True)
        processor.save_pretrained(str(out))
        metrics: dict[str, Any] = {
            "seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "warmup": warmup,
            "num_threads": num_threads, "confusion_rate": confusion_rate, "judge_share": judge_share,
            "augment": augment, "hard_negatives": hard_negatives, "vision_steps": vision_steps, "vision_lr": vision_lr,
            "vision_lr_scale": vision_lr_scale, "shape_weight": shape_weight, "vision_final_loss": None if vision_loss is None else round(vision_loss, 4),
            "vision_seconds": round(vision_s, 1), "model": model_args, "parameters": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(train_s, 1), "torch": torch.__version__,
        }
        if eval_rows is not None:
            t1 = time.time()
            metrics["eval"] = evaluate(model, processor, n_rows=eval_rows or None)
            metrics["eval_seconds"] = round(time.time() - t1, 1)
        return asset_check.write_metrics(out, metrics, verbose)


def check(shipped: str | Path = vlm.VLM_DIR, keep: str | Path | None = None, **build_kw: Any) -> Comparison:
    """Rebuild with the shipped record's arguments (``build_kw`` overrides) into a temp folder (``keep``: this
    folder instead, left in place) and compare every file ``build`` writes with the shipped one (sha256;
    ``build_metrics.json`` without its wall times)."""
    shipped = Path(shipped)
    record = json.loads((shipped / "build_metrics.json").read_text())
    kw = {k: record[k] for k in ("seed", "steps", "batch_size", "lr", "warmup", "num_threads", "confusion_rate",
                                 "judge_share", "augment", "hard_negatives", "vision_steps", "vision_lr",
                                 "vision_lr_scale", "shape_weight")}
    kw.update(record["model"])
    kw["eval_rows"] = 0 if "eval" in record else None
    kw.update(build_kw)
    return rebuild_and_compare(build, kw, shipped, BUILT_FILES, TIMING_FIELDS, keep, prefix="vlm_")


def main(argv: list[str] | None = None) -> int:
    ap, sub, b = asset_check.builder_cli("python -m tools.build_vlm", __doc__, "train the tiny VLM deterministically "
                                         "and save it", vlm.VLM_DIR, (DEFAULT_STEPS, DEFAULT_BATCH, DEFAULT_LR))
    b.add_argument("--confusion-rate", type=float, default=DEFAULT_CONFUSION_RATE)
    b.add_argument("--judge-share", type=float, default=DEFAULT_JUDGE_SHARE)
    b.add_argument("--augment", type=float, default=DEFAULT_AUGMENT)
    b.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    e = sub.add_parser("eval", help="held-out QA accuracy per type, pass@k, judge accuracy")
    e.add_argument("--path", default=None)
    e.add_argument("--n", type=int, default=None, help="held-out rows (default: all)")
    e.add_argument("--k", type=int, default=8)
    asset_check.add_check(sub, vlm.VLM_DIR)
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args.out, seed=args.seed, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
              num_threads=args.threads, confusion_rate=args.confusion_rate, judge_share=args.judge_share,
              augment=args.augment, eval_rows=None if args.no_eval else 0)
    elif args.command == "check":
        return asset_check.report_check(lambda: check(args.shipped, args.keep))
    else:
        model, processor = vlm.load_embedded_vlm(args.path)
        t0 = time.time()
        out = evaluate(model, processor, n_rows=args.n, k=args.k)
        print(json.dumps({**out, "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
