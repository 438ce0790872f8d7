"""Benchmark P2: GRPO end to end, ``unialign.trainers.OnlineTrainer`` vs TRL's ``GRPOTrainer``.

Identical on both sides: the model (the same initial weights, deep-copied), the embedded character
tokenizer and chat template (conversational prompts for both, so both condition on the same templated text),
the data (``unialign.embedded.arith.arithmetic_dataset("train")``), the reward
(``unialign.rewards.math.math_accuracy_reward``), P prompts x G generations per step, completion
length, temperature 1 / top-p 1 / top-k 0, beta = 0, token-mean ("dapo") aggregation, epsilon 0.2,
AdamW (torch, unfused; betas 0.9/0.999, eps 1e-8, wd 0), constant lr, grad clip 1.0, fp32,
no gradient checkpointing, one optimizer step per generation batch (num_iterations 1).
TRL keeps its documented defaults otherwise; the settings we change and why:
  gradient_checkpointing=False (TRL's default is True; ours does not checkpoint, so both off),
  lr_scheduler_type="constant" (ours' default; TRL's is linear decay), optim="adamw_torch" (ours
  uses torch.optim.AdamW; transformers may pick the fused variant), bf16=False (CPU, fp32 both),
  report_to=[], save_strategy="no", logging_steps=1, use_cpu on CPU.

Throughput: the two trainers run in ONE process, steps interleaved (TRL's step k is bracketed by a
callback's on_step_begin / on_step_end; our step k runs from the same callback, before TRL's step on
odd k and after it on even k, so background load and order effects hit both). A step = sample P*G
completions, score, advantages, one optimizer step. Tokens = completion tokens actually generated
(up to and including EOS). Reported: median over steps after the first (warm-up) step of
tokens/step_time.

Peak memory: each trainer alone in a fresh subprocess (same imports on both sides), peak RSS
(VmHWM) minus RSS after imports, over the same number of steps.

Embedded model: when ``unialign/embedded/assets/arith_lm/config.json`` exists, the same run on the shipped
arithmetic LM, plus held-out greedy accuracy after the same number of steps for both (few steps on CPU).
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common

LR = 3e-4  # the embedded default's GRPO lr (scripts/grpo_math.py)
# torch's own thread count, read before any trainer of ours sets one (a group runs in a fresh process): TRL's in
# P2-arith-wall (until 2026-12-07 that row read it after the tput rows had set 1, so TRL ran on one thread there)
TORCH_THREADS = torch.get_num_threads()
RANDOM_DIMS = dict(hidden=128, layers=4, heads=4, intermediate=512)  # the arith_lm architecture


def _imports():
    import datasets  # noqa: F401
    import trl  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401

    from unialign.text.policy import CausalLMPolicy  # noqa: F401
    from unialign.trainers.online import OnlineConfig, OnlineTrainer  # noqa: F401


def arith_available() -> bool:
    from unialign.embedded.arith import DEFAULT_ASSET_DIR

    return (Path(DEFAULT_ASSET_DIR) / "config.json").exists()


def build_model(kind: str, seed: int = 0):
    from unialign.embedded import arith as embedded

    if kind == "arith":
        model, tok = embedded.load_arith_lm()
    else:
        tok = embedded.build_tokenizer()
        model = embedded.build_model(tok, seed=seed, **RANDOM_DIMS)
    model.train()
    return model, tok


def train_rows(n: int | None = None):
    """The embedded task's training rows as conversations (TRL's conversational format), so that both trainers
    condition on the chat template, as the held-out evaluation (``evaluate_accuracy``) and ``grpo_math.py`` do (a
    raw string would be used untemplated: TRL's rule, which both follow)."""
    from unialign.embedded.arith import arithmetic_dataset

    return [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
            for r in arithmetic_dataset("train", n=n)]


class _TokenCountingReward:
    """math_accuracy_reward that records how many completion tokens TRL handed it (ids up to EOS)."""

    __name__ = "math_accuracy"

    def __init__(self):
        from unialign.rewards.math import math_accuracy_reward

        self.fn, self.last_tokens = math_accuracy_reward, 0

    def __call__(self, prompts, completions, completion_ids=None, answer=None, **kw):
        self.last_tokens = sum(len(c) for c in completion_ids) if completion_ids is not None else 0
        return self.fn(prompts, completions, answer=answer)


# ----------------------------------------------------------------------------- builders
def make_ours(model, tok, rows, P, G, L, steps, out_dir, seed=0, async_rollouts=False, max_staleness=1,
              config: dict | None = None, **policy_kw):
    """Ours: ``CausalLMPolicy`` + ``OnlineTrainer`` with the settings of the module docstring (GRPO preset);
    ``async_rollouts`` / ``max_staleness``: the config's; ``config``: other ``OnlineConfig`` fields to override
    (e.g. the schedule)."""
    from unialign.rewards.math import math_accuracy_reward
    from unialign.text.policy import CausalLMPolicy
    from unialign.trainers.online import OnlineConfig, OnlineTrainer

    policy = CausalLMPolicy(model, tok, max_new_tokens=L, temperature=1.0, top_p=1.0, top_k=0, **policy_kw)
    fields = dict(algorithm="grpo", beta=0.0, loss_type="dapo", num_generations=G, prompts_per_step=P,
                  micro_batch_size=P * G, num_mini_batches=1, max_steps=steps, learning_rate=LR,
                  max_completion_length=L, report_to="none", output_dir=out_dir, seed=seed,
                  lr_scheduler_type="constant", max_grad_norm=1.0, epsilon=0.2, scale_rewards="group",
                  num_iterations=1, async_rollouts=async_rollouts, max_staleness=max_staleness)
    cfg = OnlineConfig(**{**fields, **(config or {})})
    return OnlineTrainer(policy, math_accuracy_reward, rows, cfg)


def ours_step(trainer) -> tuple[float, int]:
    """One step of ours (sample, score, update), timed: (seconds, completion tokens)."""
    t0 = time.perf_counter()
    traj, _ = trainer.collect()
    tokens = 0
    if traj is not None:
        tokens = int(traj.mask_B_T.sum())
        trainer.update(traj)
    trainer.step += 1
    return time.perf_counter() - t0, tokens


def make_trl(model, tok, rows, P, G, L, steps, out_dir, callbacks=(), seed=0, **trl_args):
    """TRL's GRPOTrainer with the settings of the module docstring; ``trl_args`` override GRPOConfig fields
    (e.g. ``use_vllm=True, vllm_mode="colocate"``; HF generate by default)."""
    trl_args.setdefault("use_vllm", False)
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
    fields = dict(
        output_dir=out_dir, per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
        max_completion_length=L, temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR, beta=0.0,
        loss_type="dapo", epsilon=0.2, scale_rewards="group", num_iterations=1, report_to=[],
        bf16=False, fp16=False, gradient_checkpointing=False, lr_scheduler_type="constant", optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=1.0, max_steps=steps, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=seed, use_cpu=not cuda, dataloader_num_workers=0)
    args = GRPOConfig(**{**fields, **trl_args})
    reward = _TokenCountingReward()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=ds, processing_class=tok,
                          callbacks=list(callbacks))
    return trainer, reward


def _interleave_callback(trl_times, trl_tokens, ours_times, ours_tokens, reward, ours_trainer, others=()):
    """TRL's steps timed by its callbacks, ours run before / after them alternately; ``others``:
    further ``(trainer, times, tokens)`` of ours stepped right after ``ours_trainer`` each time."""
    from transformers import TrainerCallback

    class Interleave(TrainerCallback):
        t0 = 0.0

        def _ours(self):
            dt, n = ours_step(ours_trainer)
            ours_times.append(dt)
            ours_tokens.append(n)
            for trainer, times, tokens in others:
                gc.collect()
                dt, n = ours_step(trainer)
                times.append(dt)
                tokens.append(n)

        def on_step_begin(self, args, state, control, **kw):
            if ours_trainer is not None and state.global_step % 2 == 1:
                self._ours()
            gc.collect()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            trl_times.append(time.perf_counter() - self.t0)
            trl_tokens.append(reward.last_tokens)
            # global_step was incremented before on_step_end: step k (0-based) is global_step - 1
            if ours_trainer is not None and (state.global_step - 1) % 2 == 0:
                gc.collect()
                self._ours()

    return Interleave()


# ----------------------------------------------------------------------------- measurements
def throughput(kind: str, P: int, G: int, L: int, steps: int, eval_rows: int = 0, seed: int = 0) -> dict:
    """Both trainers in this process, steps interleaved; optional held-out greedy accuracy afterwards."""
    from unialign.embedded.arith import arithmetic_dataset, evaluate_accuracy

    base, tok = build_model(kind, seed)
    rows = train_rows()
    res: dict = {"kind": kind, "P": P, "G": G, "L": L, "steps": steps, "params": sum(p.numel() for p in base.parameters())}
    test = arithmetic_dataset("test", n=eval_rows) if eval_rows else []
    if test:
        res["acc_before"] = evaluate_accuracy(copy.deepcopy(base), tok, test)
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(seed)
        ours = make_ours(copy.deepcopy(base), copy.deepcopy(tok), rows, P, G, L, steps, os.path.join(d, "ours"), seed)
        trl_times, trl_tokens, ours_times, ours_tokens = [], [], [], []
        cb_holder = {}
        trl_model = copy.deepcopy(base)
        trainer, reward = make_trl(trl_model, copy.deepcopy(tok), rows, P, G, L, steps, os.path.join(d, "trl"),
                                   seed=seed)
        cb = _interleave_callback(trl_times, trl_tokens, ours_times, ours_tokens, reward, ours)
        trainer.add_callback(cb)
        cb_holder["cb"] = cb
        trainer.train()
        if test:
            res["acc_ours"] = evaluate_accuracy(ours.policy.model, tok, test)
            res["acc_trl"] = evaluate_accuracy(trainer.model, tok, test)
            res["eval_rows"] = len(test)
    res.update(trl_times=trl_times, trl_tokens=trl_tokens, ours_times=ours_times, ours_tokens=ours_tokens)
    tps = lambda ts, ns: [n / t for t, n in zip(ts[1:], ns[1:]) if t > 0]  # noqa: E731  (drop warm-up)
    res["ours_tok_s"] = common.median(tps(ours_times, ours_tokens))
    res["trl_tok_s"] = common.median(tps(trl_times, trl_tokens))
    res["ours_step_s"] = common.median(ours_times[1:])
    res["trl_step_s"] = common.median(trl_times[1:])
    return res


def run_seconds(trainer, steps: int) -> float:
    """Wall seconds of ``steps`` steps of ours (``train_step``: sample, score, update), from the first step's start
    to the last one's end; an async run's thread is stopped afterwards (pipeline fill included, drain excluded:
    the last step waits for nothing more)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
        trainer.step += 1
    seconds = time.perf_counter() - t0
    if trainer.rollouts is not None:
        trainer.rollouts.close()
    return seconds


def async_wall(P: int, G: int, L: int, steps: int, seed: int = 0, threads: int = 1, repeats: int = 2) -> dict:
    """Whole-loop wall time of ``steps`` GRPO steps on the embedded model: ours synchronous, ours with async rollouts
    (``max_staleness`` 1) at ``threads`` torch threads (the embedded default's 1: the rollout thread takes the second
    core), and TRL's GRPOTrainer at torch's default threads (both cores), in this process, in the order
    sync, async, TRL, then reversed, ``repeats`` times; the median per side."""
    from transformers import TrainerCallback

    base, tok = build_model("arith", seed)
    rows = train_rows()
    times: dict[str, list[float]] = {"sync": [], "async": [], "trl": []}
    default_threads = TORCH_THREADS

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.t1 = time.perf_counter()

    def one(side: str, d: str) -> None:
        gc.collect()
        torch.manual_seed(seed)
        if side == "trl":
            torch.set_num_threads(default_threads)
            clock = Clock()
            trainer, _ = make_trl(copy.deepcopy(base), copy.deepcopy(tok), rows, P, G, L, steps,
                                  os.path.join(d, f"trl{len(times[side])}"), callbacks=[clock], seed=seed)
            trainer.train()
            times[side].append(clock.t1 - clock.t0)
            return
        out = os.path.join(d, f"{side}{len(times[side])}")  # the trainer sets its own threads (config)
        trainer = make_ours(copy.deepcopy(base), copy.deepcopy(tok), rows, P, G, L, steps, out, seed,
                            async_rollouts=side == "async", max_staleness=1, config=dict(num_threads=threads))
        times[side].append(run_seconds(trainer, steps))

    try:
        with tempfile.TemporaryDirectory() as d:
            for r in range(repeats):
                order = ["sync", "async", "trl"]
                for side in order if r % 2 == 0 else order[::-1]:
                    one(side, d)
    finally:
        torch.set_num_threads(default_threads)
    return {"steps": steps, "threads": threads, "trl_threads": default_threads, "times": times,
            **{f"{k}_s": common.median(v) for k, v in times.items()}}


def memory_child(impl: str, kind: str, P: int, G: int, L: int, steps: int, seed: int = 0) -> dict:
    """One trainer alone (run in a fresh process): peak RSS over ``steps`` steps minus RSS after imports."""
    torch.manual_seed(seed)
    _imports()
    rows = train_rows()
    common.rss_tracks_tensors()
    gc.collect()
    rss0 = common.rss_bytes()
    common.reset_peak_rss()
    base, tok = build_model(kind, seed)
    with tempfile.TemporaryDirectory() as d:
        {"ours": train_ours, "trl": train_trl}[impl](base, tok, rows, P, G, L, steps, d, seed)
    peak = common.peak_rss_bytes()
    return {"impl": impl, "peak_rss_bytes": peak, "rss_after_imports": rss0, "peak_delta_bytes": peak - rss0}


def train_ours(model, tok, rows, P, G, L, steps, out_dir, seed=0) -> None:
    """Ours alone: ``steps`` GRPO steps of ``OnlineTrainer``."""
    tr = make_ours(model, tok, rows, P, G, L, steps, out_dir, seed)
    for _ in range(steps):
        ours_step(tr)


def train_trl(model, tok, rows, P, G, L, steps, out_dir, seed=0) -> None:
    """TRL alone: ``GRPOTrainer.train()`` for ``steps`` steps."""
    tr, _ = make_trl(model, tok, rows, P, G, L, steps, out_dir, seed=seed)
    tr.train()


def run(quick: bool = False) -> list[dict]:
    # L = 32: the embedded task's correct answers are 20-25 tokens with EOS (24 cut the longest ones off)
    # quick: a smoke run (2 prompts x 4, 16 tokens, 2 steps, 1-step memory children): every row, no meaning
    P, G, L = (2, 4, 16) if quick else (8, 8, 32)
    steps = 2 if quick else 8
    kinds = ["random"] + (["arith"] if arith_available() else [])
    rows = []
    for kind in kinds:
        tag = "P2" if kind == "random" else "P2-arith"
        model_desc = (f"random-init Llama h{RANDOM_DIMS['hidden']} x{RANDOM_DIMS['layers']}L" if kind == "random"
                      else "embedded arith_lm")
        eval_rows = 0 if kind == "random" else (16 if quick else 256)
        st = steps if kind == "random" else (2 if quick else 20)
        setting = (f"{model_desc}; P={P} prompts x G={G}, max {L} new tokens, beta=0, dapo/token-mean, "
                  f"lr {LR}, {st} steps (median of steps 2..{st}; interleaved in one process); CPU fp32")
        try:
            r = throughput(kind, P, G, L, st, eval_rows=eval_rows)
            rows.append(common.row(f"{tag}-tput", "GRPO completion tokens/s (sample+score+update)", r["ours_tok_s"],
                                   r["trl_tok_s"], "tok/s", "higher", 1.5, setting,
                                   ours_step_s=r["ours_step_s"], baseline_step_s=r["trl_step_s"], raw=r))
            if eval_rows:
                rows.append(common.row(f"{tag}-acc", f"held-out greedy accuracy after {st} steps ({r['eval_rows']} rows)",
                                       r["acc_ours"], r["acc_trl"], "frac", "higher", None,
                                       f"before training: {r['acc_before']:.3f}; few steps on CPU, so this only checks "
                                       "that both learn comparably (data order differs: TRL shuffles its own way; seed "
                                       "noise is large, see benchmarks/README.md)"))
        except Exception as e:  # noqa: BLE001
            rows.append(common.error_row(f"{tag}-tput", "GRPO completion tokens/s", e))
        if kind == "arith":
            try:
                st = 2 if quick else 20
                w = async_wall(P, G, L, st, repeats=1 if quick else 2)
                setting = (f"embedded arith_lm; P={P} x G={G}, max {L} new tokens, grpo/dapo token-mean, lr {LR}; "
                           f"{st} steps timed whole (sample, score, update; the async pipeline's fill included), "
                           f"median of {len(w['times']['sync'])} runs per side in one process, order alternated; ours at "
                           f"{w['threads']} torch thread (the embedded default; the rollout thread takes the other "
                           f"core), TRL at {w['trl_threads']}")
                rows.append(common.row(
                    "P2-arith-async", "seconds per GRPO step, async rollouts (max_staleness 1) vs ours synchronous",
                    w["async_s"] / st, w["sync_s"] / st, "s/step", "lower", None,
                    setting + "; informative: what overlap buys, not learning (docs/scaling.md: async learns less "
                    "on this task)", raw=w))
                rows.append(common.row(
                    "P2-arith-wall", "seconds per GRPO step, ours async vs TRL GRPOTrainer (synchronous; TRL's "
                    "AsyncGRPOTrainer needs a vLLM server)", w["async_s"] / st, w["trl_s"] / st, "s/step", "lower",
                    None, setting + f"; ours synchronous: {w['sync_s'] / st:.3f} s/step", raw=w))
            except Exception as e:  # noqa: BLE001
                rows.append(common.error_row("P2-arith-async", "seconds per GRPO step, async rollouts", e))
        mem_steps = 1 if quick else 3
        rows.append(common.peak_memory_row(
            f"{tag}-mem", "GRPO", "p2_grpo", dict(kind=kind, P=P, G=G, L=L, steps=mem_steps),
            f"{model_desc}; each trainer alone in a fresh process, {mem_steps} steps; peak VmHWM minus RSS after "
            "importing both libraries; informative (no target)"))
    return rows


if __name__ == "__main__":
    import json

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1, default=str))
