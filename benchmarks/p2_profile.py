"""Benchmark P2P: where a GRPO step's time goes (ours, the embedded arithmetic model, P2's harness).

``breakdown(L)`` times the phases of ``OnlineTrainer.train_step`` by wrapping, on the instances, the calls that make
them: generation (the rollout engine's ``generate``), the sampling-time scoring forward (``policy._forward`` inside
``sample``; only until the first ratio check, after which the update's own forward gives the old log-probs), the
reward functions, the advantages, the loss forward (``policy.loss_forward``), the backward, and the optimizer
(gradient clipping, ``step``, ``zero_grad``). ``other`` is the step's wall time minus those: the loop's own
Python (batch layout, selection, masks, metrics, gathers). Steps after the first two (warm-up, ratio check) are
summed; the shares are of their total.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time

import torch

from benchmarks import common
from benchmarks.p2_grpo import build_model, make_ours, train_rows

PHASES = ("generate", "score_forward", "reward", "advantages", "loss_forward", "backward", "optimizer")


def _timed(fn, clock: dict, phase: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[phase] = clock.get(phase, 0.0) + time.perf_counter() - t0
    return wrapper


def breakdown(L: int, P: int = 16, G: int = 8, steps: int = 12, warmup: int = 2, threads: int = 1) -> dict:
    """Seconds per phase summed over ``steps - warmup`` steps of GRPO at ``L`` new tokens (``threads`` torch
    threads: the embedded default's 1)."""
    base, tok = build_model("arith", 0)
    previous = torch.get_num_threads()  # the trainer sets its own (config), restored afterwards
    clock: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory() as d:
            trainer = make_ours(base, tok, train_rows(), P, G, L, steps, os.path.join(d, "ours"), 0,
                                config=dict(lr_scheduler_type="cosine", warmup_steps=5, num_threads=threads))
            policy = trainer.policy
            policy.rollout.generate = _timed(policy.rollout.generate, clock, "generate")
            forward = policy._forward
            in_sample = {"on": False}

            def scoring_forward(*args, **kwargs):  # only the forward ``sample`` runs counts as scoring
                if not in_sample["on"]:
                    return forward(*args, **kwargs)
                return _timed(forward, clock, "score_forward")(*args, **kwargs)

            sample = policy.sample

            def sample_marked(*args, **kwargs):
                in_sample["on"] = True
                try:
                    return sample(*args, **kwargs)
                finally:
                    in_sample["on"] = False

            policy._forward, policy.sample = scoring_forward, sample_marked
            trainer.reward_fn = _timed(trainer.reward_fn, clock, "reward")
            trainer._advantages = _timed(trainer._advantages, clock, "advantages")
            policy.loss_forward = _timed(policy.loss_forward, clock, "loss_forward")
            trainer.acc.backward = _timed(trainer.acc.backward, clock, "backward")
            for name in ("step", "zero_grad"):
                setattr(trainer.optimizer, name, _timed(getattr(trainer.optimizer, name), clock, "optimizer"))
            trainer.acc.clip_grad_norm_ = _timed(trainer.acc.clip_grad_norm_, clock, "optimizer")
            total, tokens = 0.0, 0
            for step in range(steps):
                if step == warmup:
                    clock.clear()
                t0 = time.perf_counter()
                stats = trainer.train_step()
                trainer.step += 1
                if step >= warmup:
                    total += time.perf_counter() - t0
                    tokens += stats.get("completion_length", 0.0) * P * G
    finally:
        torch.set_num_threads(previous)
    seconds = {p: clock.get(p, 0.0) for p in PHASES}
    seconds["other"] = total - sum(seconds.values())
    n = steps - warmup
    return {"L": L, "steps": n, "step_s": total / n, "tokens_per_step": tokens / n,
            "seconds_per_step": {k: v / n for k, v in seconds.items()},
            "share": {k: v / total for k, v in seconds.items()}}


def run(quick: bool = False) -> list[dict]:
    rows = []
    for L in (16, 32):
        try:
            b = breakdown(L, steps=3, warmup=1) if quick else breakdown(L)
        except Exception as e:  # noqa: BLE001
            rows.append(common.error_row(f"P2P-{L}", "GRPO step breakdown", e))
            continue
        parts = ", ".join(f"{k} {v:.0%}" for k, v in sorted(b["share"].items(), key=lambda kv: -kv[1]))
        rows.append(common.row(
            f"P2P-{L}", f"GRPO step time at {L} new tokens, and where it goes (ours)", b["step_s"], None, "s/step",
            "lower", None, f"embedded arith_lm, P=16 x G=8, 1 torch thread, {b['steps']} steps after 2 of warm-up, "
            f"{b['tokens_per_step']:.0f} completion tokens per step; shares: {parts}", raw=b))
    return rows


if __name__ == "__main__":
    import json

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1, default=str))
