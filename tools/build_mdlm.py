"""How the shipped masked-diffusion LM (``unialign/embedded/assets/mdlm``, ``--model_name_or_path embedded-mdlm``)
is built: the tokenizer and tiny ModernBERT of ``unialign.embedded.mdlm`` and LLaDA's supervised fine-tuning on
the arithmetic task with carry-drop label noise (why: ``unialign.embedded.arith``), plus the check that a rebuild
gives the shipped files.

CLI (from the repository root)::

    python -m tools.build_mdlm build --out DIR   # deterministic rebuild (same machine / torch / threads)
    python -m tools.build_mdlm eval [--path DIR] # greedy accuracy and pass@8 on held-out rows (block decoding)
    python -m tools.build_mdlm check [--keep DIR]  # build into a temp folder, compare with the shipped one

The SFT loss (LLaDA, Nie et al. 2025, eq. 5): for each row a time t ~ U(0, 1), each completion token (the answer,
``<|im_end|>`` and the ``<|im_end|>`` fill to ``GEN_LENGTH``) masked with probability t, the cross-entropy of the
masked tokens weighted 1/t, summed and divided by the completion length. The prompt is never masked.
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
from unialign.embedded.arith import EOS, _operands, arithmetic_dataset, chat_prompt, is_correct, worked_answer
from unialign.embedded.mdlm import GEN_LENGTH, MDLM_DIR, SAMPLING, build_model, build_tokenizer
from unialign.text.tokens import encode_prompt

DEFAULT_STEPS = 3000
DEFAULT_BATCH = 32
DEFAULT_LR = 3e-3
# 0.6, not the causal model's 0.4: block decoding commits the carry digit by its argmax, so the model's P(+1) must
# fall under 1/2 for greedy decoding to miss it (0.4 gave greedy 0.79, pass@8 0.98: little room for RL)
DEFAULT_CARRY_DROP = 0.6
BUILT_FILES = ("build_metrics.json", "chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json")
TIMING_FIELDS = ("train_seconds",)
RECORDED = ("seed", "steps", "batch_size", "lr", "warmup", "num_threads", "carry_drop")  # check rebuilds with these


def _encode(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, completion block of GEN_LENGTH ids: the answer, <|im_end|>, <|im_end|> fill)."""
    p = encode_prompt(tokenizer, chat_prompt(tokenizer, row["question"]), templated=True)
    a = tokenizer.encode(row["answer"] + EOS, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return p, (a + [eos] * GEN_LENGTH)[:GEN_LENGTH]


def _collate(batch: list[tuple[list[int], list[int]]], pad_id: int):
    """Left-padded prompts + completion blocks: ids, attention mask, position ids, completion start."""
    P = max(len(p) for p, _ in batch)
    ids = torch.full((len(batch), P + GEN_LENGTH), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(batch):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:] = torch.tensor(c)
        mask[i, P - len(p):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), P


def sft_loss(model, ids, mask, pos, P: int, mask_id: int, gen: torch.Generator) -> torch.Tensor:
    """LLaDA's SFT loss on the completion block (module docstring)."""
    B = ids.shape[0]
    t = torch.rand(B, 1, generator=gen).clamp(min=1e-3)
    masked = torch.rand(B, GEN_LENGTH, generator=gen) < t
    noisy = ids.clone()
    noisy[:, P:] = torch.where(masked, torch.full_like(ids[:, P:], mask_id), ids[:, P:])
    logits = model(input_ids=noisy, attention_mask=mask, position_ids=pos).logits[:, P:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, P:].reshape(-1),
                                           reduction="none").view(B, GEN_LENGTH)
    return (ce * masked / t).sum(-1).mean() / GEN_LENGTH


def build(out_dir: str | Path, seed: int = 0, steps: int = DEFAULT_STEPS, batch_size: int = DEFAULT_BATCH,
          lr: float = DEFAULT_LR, warmup: int = 100, num_threads: int = 1, eval_rows: int = 256,
          carry_drop: float = DEFAULT_CARRY_DROP, log_every: int = 250, verbose: bool = True, **model_kw) -> dict:
    """Train the tiny ModernBERT for a fixed number of ``steps`` (AdamW, linear warmup, cosine decay to 0) and save
    it with the tokenizer to ``out_dir``; deterministic for a ``seed`` on one machine and torch build. Returns the
    measurements (also in ``out_dir/build_metrics.json``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with asset_check.deterministic(num_threads):
        tok = build_tokenizer()
        model = build_model(tok, seed=seed, **model_kw)
        rows = arithmetic_dataset("train", seed=seed)
        noise_rng, rng = random.Random(f"carry-drop-{seed}"), random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        cache: dict[tuple[int, bool], tuple[list[int], list[int]]] = {}

        def encoded(i: int):
            a, b = _operands(rows[i]["answer"])
            drop = carry_drop > 0 and a % 10 + b % 10 >= 10 and noise_rng.random() < carry_drop
            if (i, drop) not in cache:
                row = {"question": rows[i]["question"], "answer": worked_answer(a, b, drop_carry=drop)}
                cache[i, drop] = _encode(tok, row)
            return cache[i, drop]

        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
        order: list[int] = []
        model.train()
        for step in range(steps):
            if len(order) < batch_size:
                perm = list(range(len(rows)))
                rng.shuffle(perm)
                order += perm
            idx, order = order[:batch_size], order[batch_size:]
            ids, mask, pos, P = _collate([encoded(i) for i in idx], tok.pad_token_id)
            scale = (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
            for g in opt.param_groups:
                g["lr"] = lr * scale
            loss = sft_loss(model, ids, mask, pos, P, tok.mask_token_id, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if verbose and (step % log_every == 0 or step == steps - 1):
                print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - t0:.0f}s", flush=True)
        train_s = time.time() - t0
        model.eval()
        model.config.unialign_sampling = SAMPLING  # the sampling it was built for (config.json; flags override it)
        model.save_pretrained(str(out), safe_serialization=True)
        tok.save_pretrained(str(out))
        metrics: dict[str, Any] = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "warmup": warmup,
                                   "num_threads": num_threads, "carry_drop": carry_drop,
                                   "train_seconds": round(train_s, 1), "torch": torch.__version__}
        if eval_rows:
            metrics.update(evaluate(out, eval_rows))
        return asset_check.write_metrics(out, metrics, verbose)


def evaluate(path: str | Path, n: int | None = 256, k: int = 8, seed: int = 0) -> dict[str, Any]:
    """Greedy accuracy and pass@k (temperature 1) of block decoding with the embedded sampling, on ``n``
    held-out rows."""
    from unialign.dlm import MaskedDiffusionLMPolicy

    policy = MaskedDiffusionLMPolicy.from_pretrained(str(path))  # its recorded sampling (SAMPLING)
    rows = arithmetic_dataset("test", n=n)
    prompts = [[{"role": "user", "content": r["question"]}] for r in rows]
    greedy = policy.generate(prompts, greedy=True)["texts"]
    torch.manual_seed(seed)
    hits = [False] * len(rows)
    for _ in range(k):
        texts = policy.generate(prompts)["texts"]
        hits = [h or is_correct(t, r["answer"]) for h, t, r in zip(hits, texts, rows)]
    return {"greedy_acc": sum(is_correct(t, r["answer"]) for t, r in zip(greedy, rows)) / len(rows),
            f"pass_at_{k}": sum(hits) / len(rows), "eval_rows": len(rows)}


def check(shipped: str | Path = MDLM_DIR, keep: str | Path | None = None, **build_kw: Any) -> Comparison:
    """Rebuild with the shipped record's arguments into a temp folder (``keep``: this one) and compare every file
    ``build`` writes with the shipped one (sha256; ``build_metrics.json`` without its wall time)."""
    return rebuild_from_record(build, shipped, RECORDED, BUILT_FILES, TIMING_FIELDS, keep, prefix="mdlm_", **build_kw)


def main(argv: list[str] | None = None) -> int:
    ap, sub, b = asset_check.builder_cli("python -m tools.build_mdlm", __doc__, "train the tiny masked-diffusion LM "
                                         "deterministically and save it", MDLM_DIR,
                                         (DEFAULT_STEPS, DEFAULT_BATCH, DEFAULT_LR))
    b.add_argument("--carry-drop", type=float, default=DEFAULT_CARRY_DROP)
    b.add_argument("--eval-rows", type=int, default=256)
    e = sub.add_parser("eval", help="greedy accuracy and pass@k on held-out rows")
    e.add_argument("--path", default=str(MDLM_DIR))
    e.add_argument("--n", type=int, default=256, help="held-out rows")
    e.add_argument("--k", type=int, default=8)
    asset_check.add_check(sub, MDLM_DIR)
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args.out, seed=args.seed, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
              num_threads=args.threads, eval_rows=args.eval_rows, carry_drop=args.carry_drop)
    elif args.command == "check":
        return asset_check.report_check(lambda: check(args.shipped, args.keep))
    else:
        t0 = time.time()
        print(json.dumps({**evaluate(args.path, args.n, args.k), "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
