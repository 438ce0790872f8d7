"""Benchmark P3: DPO, ``unialign.trainers.PreferenceTrainer`` + ``DPOObjective`` vs TRL's ``DPOTrainer``.

Identical on both sides: the model (same initial weights, deep-copied; a random-init Llama with the
arith_lm architecture and the embedded character tokenizer), the pairs (standard format
prompt / chosen / rejected strings: the chat-templated arithmetic question, the correct worked answer,
the same answer with a wrong result), EOS appended to each completion by both, beta 0.1, sigmoid
loss, a full-copy reference (ours: ``policy.reference()`` deep-copies; TRL: ``ref_model=`` a deep
copy, since a random-init model has no hub id to reload), no reference precompute, batch size B in one
micro-batch, AdamW (torch), constant lr, grad clip 1.0, fp32, gradient checkpointing off on both
(TRL's default is on; ours has none). ``max_length=None`` on TRL (no truncation; pairs are ~100 tokens).
Ours runs with ``chat_template='auto'`` (a string prompt raw, as TRL) because the prompt strings are already templated, exactly
as TRL treats standard-format string prompts; the two then tokenise to the same ids.

Step time: both trainers in one process, steps interleaved (ours' step k inside TRL's step callbacks,
before TRL's on odd k, after on even k); median after the first step. First-step loss: at
initialisation policy == reference, so both must give ln 2 = 0.693147. Peak memory: each trainer
alone in a fresh process, peak RSS minus RSS after imports.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import sys
import tempfile
import time

import torch

from benchmarks import common
from benchmarks.p2_grpo import RANDOM_DIMS, build_model

LR = 1e-5
BETA = 0.1


def pairs(n: int = 512) -> list[dict]:
    from unialign.embedded.arith import arithmetic_dataset, build_tokenizer, chat_prompt

    tok = build_tokenizer()
    out = []
    for i, r in enumerate(arithmetic_dataset("train", n=n)):
        body, final = r["answer"].rsplit("#### ", 1)  # the worked steps, then the final value
        wrong = str(int(final) + (1 + i % 9) * (1 if i % 2 else -1))
        out.append({"prompt": chat_prompt(tok, r["question"]), "chosen": r["answer"],
                    "rejected": f"{body}#### {wrong}"})
    return out


def make_ours(model, tok, rows, B, steps, out_dir, seed=0):
    """Ours: ``CausalLMPolicy`` + ``DPOObjective`` in a ``PreferenceTrainer`` (settings of the module docstring)."""
    from unialign.text.policy import CausalLMPolicy
    from unialign.trainers.preference import DPOObjective, PreferenceConfig, PreferenceTrainer

    policy = CausalLMPolicy(model, tok)  # chat_template='auto': the strings raw
    obj = DPOObjective(policy, beta=BETA, loss_type="sigmoid")
    cfg = PreferenceConfig(batch_size=B, micro_batch_size=B, max_steps=steps, learning_rate=LR, report_to="none",
                           output_dir=out_dir, seed=seed, lr_scheduler_type="constant", max_grad_norm=1.0)
    return PreferenceTrainer(obj, rows, cfg)


def make_trl(model, tok, rows, B, steps, out_dir, callbacks=(), seed=0):
    """TRL's ``DPOTrainer`` with a deep-copied reference (settings of the module docstring)."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
    args = DPOConfig(output_dir=out_dir, per_device_train_batch_size=B, gradient_accumulation_steps=1,
                     learning_rate=LR, beta=BETA, loss_type=["sigmoid"], precompute_ref_log_probs=False,
                     max_length=None, gradient_checkpointing=False, bf16=False, fp16=False, report_to=[],
                     lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0,
                     max_steps=steps, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=seed,
                     use_cpu=not cuda, dataloader_num_workers=0)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    return DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(rows),
                      processing_class=tok, callbacks=list(callbacks))


def ours_step(trainer) -> tuple[float, float]:
    """One optimizer step of ours, timed after a ``gc.collect()``: (seconds, loss)."""
    gc.collect()
    t0 = time.perf_counter()
    m = trainer.train_step()
    return time.perf_counter() - t0, m["loss"]


def train_ours(model, tok, rows, B, steps, out_dir, seed=0) -> None:
    """Ours alone: ``steps`` optimizer steps of ``PreferenceTrainer``."""
    tr = make_ours(model, tok, rows, B, steps, out_dir, seed)
    for _ in range(steps):
        tr.train_step()


def train_trl(model, tok, rows, B, steps, out_dir, seed=0) -> None:
    """TRL alone: ``DPOTrainer.train()`` for ``steps`` steps."""
    make_trl(model, tok, rows, B, steps, out_dir, seed=seed).train()


def step_times(B: int, steps: int, seed: int = 0) -> dict:
    """Both trainers in this process, ours' steps inside TRL's step callbacks (before TRL's on odd steps, after on
    even ones); step times and losses of both."""
    from transformers import TrainerCallback

    base, tok = build_model("random", seed)
    rows = pairs()
    ours_t, trl_t, ours_loss, trl_loss = [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        ours = make_ours(copy.deepcopy(base), copy.deepcopy(tok), rows, B, steps, os.path.join(d, "o"), seed)

        def ours_step_():
            dt, loss = ours_step(ours)
            ours_t.append(dt)
            ours_loss.append(loss)

        class Interleave(TrainerCallback):
            t0 = 0.0

            def on_step_begin(self, args, state, control, **kw):
                if state.global_step % 2 == 1:
                    ours_step_()
                gc.collect()
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                trl_t.append(time.perf_counter() - self.t0)
                if (state.global_step - 1) % 2 == 0:
                    ours_step_()

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    trl_loss.append(float(logs["loss"]))

        tr = make_trl(copy.deepcopy(base), copy.deepcopy(tok), rows, B, steps, os.path.join(d, "t"), seed=seed)
        tr.add_callback(Interleave())
        tr.train()
    return {"ours_times": ours_t, "trl_times": trl_t, "ours_losses": ours_loss, "trl_losses": trl_loss,
            "ours_step_s": common.median(ours_t[1:]), "trl_step_s": common.median(trl_t[1:])}


def memory_child(impl: str, B: int, steps: int, seed: int = 0) -> dict:
    """One trainer alone (run in a fresh process): peak RSS over ``steps`` steps minus RSS after imports."""
    import datasets  # noqa: F401
    import trl  # noqa: F401
    from trl import DPOTrainer  # noqa: F401

    from unialign.trainers.preference import PreferenceTrainer  # noqa: F401

    torch.manual_seed(seed)
    rows = pairs()
    common.rss_tracks_tensors()
    gc.collect()
    rss0 = common.rss_bytes()
    common.reset_peak_rss()
    base, tok = build_model("random", seed)
    with tempfile.TemporaryDirectory() as d:
        {"ours": train_ours, "trl": train_trl}[impl](base, tok, rows, B, steps, d, seed)
    peak = common.peak_rss_bytes()
    return {"impl": impl, "peak_rss_bytes": peak, "peak_delta_bytes": peak - rss0}


def run(quick: bool = False) -> list[dict]:
    B = 4 if quick else 8
    steps = 2 if quick else 15  # quick: a smoke run, every row
    desc = (f"random-init Llama h{RANDOM_DIMS['hidden']} x{RANDOM_DIMS['layers']}L, char tokenizer; B={B} pairs, "
            f"beta {BETA}, sigmoid, full-copy reference, no precompute, grad checkpointing off on both; CPU fp32")
    rows = []
    try:
        r = step_times(B, steps)
        rows.append(common.row("P3-time", "DPO optimizer-step time", r["ours_step_s"], r["trl_step_s"], "s", "lower", None,
                               f"{desc}; median of steps 2..{steps}, interleaved in one process; informative (no target)",
                               raw=r))
        lo, lt = (r["ours_losses"] or [None])[0], (r["trl_losses"] or [None])[0]
        diff = abs(lo - lt) if lo is not None and lt is not None else None
        rows.append(common.row("P3-loss0", "first-step DPO loss (ln 2 = 0.693147 expected)", lo, lt, "nats", "lower", None,
                               f"|ours - TRL| = {diff:.3g}; |ours - ln2| = {abs(lo - math.log(2)):.3g}; "
                               f"|TRL - ln2| = {abs(lt - math.log(2)):.3g}" if diff is not None else "loss missing",
                               abs_diff=diff, ln2=math.log(2)))
    except Exception as e:  # noqa: BLE001
        rows.append(common.error_row("P3-time", "DPO optimizer-step time", e))
    mem_steps = 1 if quick else 3
    rows.append(common.peak_memory_row("P3-mem", "DPO", "p3_dpo", dict(B=B, steps=mem_steps),
                                       f"each trainer alone in a fresh process, {mem_steps} steps; informative (no "
                                       "target)"))
    return rows


if __name__ == "__main__":
    import json

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1, default=str))
