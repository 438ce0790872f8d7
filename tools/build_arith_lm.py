"""How the shipped arithmetic LM (``unialign/embedded/assets/arith_lm``) is built: the tokenizer, the tiny Llama
of ``unialign.embedded.arith`` and its supervised warm start with carry-drop label noise (why: that module's
docstring), plus the check that a rebuild gives the shipped files.

CLI (from the repository root)::

    python -m tools.build_arith_lm build --out DIR   # deterministic rebuild (any AVX2 CPU, same torch / threads)
    python -m tools.build_arith_lm eval [--path DIR] # greedy accuracy and pass@8 on held-out rows
    python -m tools.build_arith_lm check [--keep DIR]  # build into a temp folder, compare with the shipped one

``build`` and ``check`` run with ``asset_check.PORTABLE_KERNELS`` (MKL's portable GEMM path and ATen's AVX2
kernels, set by starting the command again in a child process): without them the 560 training steps amplify the
last-bit differences of each CPU's own kernels and an AMD or an Intel machine trains other weights; with them every
x86-64 CPU with AVX2 and FMA gives the same bytes (torch 2.14.1, one thread). The record names the kernels it ran
with; ``build()`` called in a process without them is deterministic on that machine only.
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
from unialign.embedded.arith import (
    DEFAULT_ASSET_DIR,
    EOS,
    _operands,
    arithmetic_dataset,
    build_model,
    build_tokenizer,
    chat_prompt,
    evaluate_accuracy,
    load_arith_lm,
    pass_at_k,
    worked_answer,
)
from unialign.text.tokens import encode_prompt

DEFAULT_STEPS = 560
DEFAULT_BATCH = 32
DEFAULT_LR = 3e-3
DEFAULT_CARRY_DROP = 0.6
# what `build` writes (BUILD.md beside them is written by hand); build_metrics.json carries the wall time
BUILT_FILES = ("build_metrics.json", "chat_template.jinja", "config.json", "generation_config.json",
               "model.safetensors", "tokenizer.json", "tokenizer_config.json")
TIMING_FIELDS = ("train_seconds",)
RECORDED = ("seed", "steps", "batch_size", "lr", "warmup", "num_threads", "carry_drop")  # check rebuilds with these


def _encode_sft(tokenizer, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(token ids of prompt + answer + <|im_end|>, prompt length) per row."""
    out = []
    for r in rows:
        p = encode_prompt(tokenizer, chat_prompt(tokenizer, r["question"]), templated=True)
        a = tokenizer.encode(r["answer"] + EOS, add_special_tokens=False)
        out.append((p + a, len(p)))
    return out


def _collate(batch: list[tuple[list[int], int]], pad_id: int):
    """Left-padded input ids, attention mask and labels (-100 outside the assistant answer)."""
    L = max(len(ids) for ids, _ in batch)
    ids_t = torch.full((len(batch), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), L), dtype=torch.long)
    labels = torch.full((len(batch), L), -100, dtype=torch.long)
    for i, (ids, plen) in enumerate(batch):
        off = L - len(ids)
        ids_t[i, off:] = torch.tensor(ids)
        mask[i, off:] = 1
        labels[i, off + plen:] = torch.tensor(ids[plen:])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids_t, mask, labels, pos


def build(out_dir: str | Path, seed: int = 0, steps: int = DEFAULT_STEPS, batch_size: int = DEFAULT_BATCH,
          lr: float = DEFAULT_LR, warmup: int = 50, num_threads: int = 1, eval_rows: int = 256,
          carry_drop: float | None = None,
          log_every: int = 100, callback=None, verbose: bool = True, **model_kw) -> dict:
    """Build the tokenizer, train the tiny Llama with supervised next-token loss on the assistant answer
    for a FIXED number of ``steps`` (AdamW, linear warmup, cosine decay to 0), save both to ``out_dir``.
    ``carry_drop`` (default ``DEFAULT_CARRY_DROP``): probability that a drawn training row needing a
    carry gets the carry-dropped (wrong) target instead (label noise; see ``unialign.embedded.arith``).

    Deterministic for a given ``seed`` and torch build (fixed thread count, deterministic algorithms, seeded data
    order) on one machine, and on every AVX2 machine when the process runs with ``asset_check.PORTABLE_KERNELS``
    (the command line sees to it; the record's ``kernels`` says which). Returns a dict of measurements (also written to
    ``out_dir/build_metrics.json``). ``callback(step, model, tokenizer)`` is called every ``log_every``
    steps (for exploration).
    """
    carry_drop = DEFAULT_CARRY_DROP if carry_drop is None else carry_drop
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with asset_check.deterministic(num_threads):
        tok = build_tokenizer()
        model = build_model(tok, seed=seed, **model_kw)
        train_rows = arithmetic_dataset("train", seed=seed)
        cache: dict[tuple[int, bool], tuple[list[int], int]] = {}
        noise_rng = random.Random(f"carry-drop-{seed}")

        def encoded(i: int) -> tuple[list[int], int]:
            row = train_rows[i]
            a, b = _operands(row["answer"])
            drop = carry_drop > 0 and a % 10 + b % 10 >= 10 and noise_rng.random() < carry_drop
            if (i, drop) not in cache:
                if drop:
                    row = {"question": row["question"], "answer": worked_answer(a, b, drop_carry=True)}
                cache[i, drop] = _encode_sft(tok, [row])[0]
            return cache[i, drop]

        rng = random.Random(seed)
        order: list[int] = []
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

        def lr_at(s: int) -> float:
            if s < warmup:
                return lr * (s + 1) / warmup
            return lr * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

        model.train()
        for step in range(steps):
            if len(order) < batch_size:
                perm = list(range(len(train_rows)))
                rng.shuffle(perm)
                order += perm
            idx, order = order[:batch_size], order[batch_size:]
            ids, mask, labels, pos = _collate([encoded(i) for i in idx], tok.pad_token_id)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if verbose and (step % log_every == 0 or step == steps - 1):
                print(f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step):.2e}  "
                      f"{time.time() - t0:.0f}s", flush=True)
            if callback is not None and (step + 1) % log_every == 0:
                callback(step + 1, model, tok)
        train_s = time.time() - t0
        model.eval()
        model.save_pretrained(str(out), safe_serialization=True)
        tok.save_pretrained(str(out))
        metrics: dict[str, Any] = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr,
                                   "warmup": warmup, "num_threads": num_threads, "carry_drop": carry_drop,
                                   "train_seconds": round(train_s, 1), "torch": torch.__version__,
                                   "kernels": asset_check.kernels_record()}
        if eval_rows:
            test = arithmetic_dataset("test", n=eval_rows)
            metrics["greedy_acc"] = evaluate_accuracy(model, tok, test)
            metrics["pass_at_8"] = pass_at_k(model, tok, test, k=8)
            metrics["eval_rows"] = len(test)
        return asset_check.write_metrics(out, metrics, verbose)


def check(shipped: str | Path = DEFAULT_ASSET_DIR, keep: str | Path | None = None, **build_kw: Any) -> Comparison:
    """Rebuild with the shipped record's arguments (``build_metrics.json``: seed, steps, batch size, lr,
    warmup, threads, carry drop, evaluation rows; ``build_kw`` overrides) into a temp folder (``keep``: this
    folder instead, left in place) and compare every file ``build`` writes with the shipped one (sha256;
    ``build_metrics.json`` without its wall time)."""
    return rebuild_from_record(build, shipped, RECORDED, BUILT_FILES, TIMING_FIELDS, keep, prefix="arith_lm_", **build_kw)


def main(argv: list[str] | None = None) -> int:
    ap, sub, b = asset_check.builder_cli("python -m tools.build_arith_lm", __doc__, "train the tiny arithmetic LM "
                                         "deterministically and save it", DEFAULT_ASSET_DIR,
                                         (DEFAULT_STEPS, DEFAULT_BATCH, DEFAULT_LR))
    b.add_argument("--carry-drop", type=float, default=DEFAULT_CARRY_DROP)
    b.add_argument("--eval-rows", type=int, default=256)
    e = sub.add_parser("eval", help="greedy accuracy and pass@k on held-out rows")
    e.add_argument("--path", default=None)
    e.add_argument("--n", type=int, default=None, help="held-out rows (default: all)")
    e.add_argument("--k", type=int, default=8)
    asset_check.add_check(sub, DEFAULT_ASSET_DIR)
    args = ap.parse_args(argv)
    if args.command in ("build", "check") and not asset_check.portable_kernels():
        return asset_check.run_with_portable_kernels("tools.build_arith_lm", sys.argv[1:] if argv is None else argv)
    if args.command == "build":
        build(args.out, seed=args.seed, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
              num_threads=args.threads, eval_rows=args.eval_rows, carry_drop=args.carry_drop)
    elif args.command == "check":
        return asset_check.report_check(lambda: check(args.shipped, args.keep))
    else:
        model, tok = load_arith_lm(args.path)
        rows = arithmetic_dataset("test", n=args.n)
        t0 = time.time()
        g = evaluate_accuracy(model, tok, rows)
        p = pass_at_k(model, tok, rows, k=args.k)
        print(json.dumps({"rows": len(rows), "greedy_acc": round(g, 4), f"pass_at_{args.k}": round(p, 4),
                          "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
