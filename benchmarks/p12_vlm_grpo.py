"""Benchmark P12: GRPO on a vision-language model, ``OnlineTrainer`` + ``VisionLanguagePolicy`` vs TRL's ``GRPOTrainer``.

P2's harness (``benchmarks.p2_grpo``: one process, steps interleaved through a TRL callback, tokens/s median
after the warm-up step, peak memory of each side alone in a fresh subprocess) on image-in text-out GRPO.

Identical on both sides: the model (the same initial weights, deep-copied ``Qwen2VLForConditionalGeneration``, an
``AutoModelForImageTextToText``) and its processor; the data (TRL's vision rows ``{"prompt": [user turn with an
image block and the question], "image": PIL, "solution", ...}``: ``unialign.embedded.vlm.vlm_dataset("train")``, or
the tiny model's random images; read by ours through ``unialign.vision.vision_rows``, by TRL as a
``datasets.Dataset`` with ``prompt`` and ``image`` columns, so both render the same chat template with the same image
placeholders); the reward (``unialign.embedded.vlm.accuracy_reward`` / ``length_reward``, TRL's signature, the
``solution`` column); and the knobs of the embedded run, ``scripts/grpo_vision.py``'s defaults: P = 16 prompts x G = 8 generations per step, at most 8 new tokens,
temperature 1 / top-p 1 / top-k 0 (image tokens suppressed in sampling on both sides), beta = 0, the GRPO preset's
aggregation (sequence mean of token means, TRL ``loss_type="grpo"``), epsilon 0.2, group-std reward scaling,
lr 1e-3, one micro-batch of all P x G completions, AdamW (torch, unfused; betas 0.9/0.999, eps 1e-8, wd 0),
grad clip 1.0, fp32, no gradient checkpointing, one optimizer step per generation batch (num_iterations 1), one
torch thread (the script's ``num_threads`` default). Changed from the script: a constant learning rate with no
warm-up (the script warms up 5 steps, then cosine; a constant rate keeps a short comparison's steps alike). The
vision tower is frozen on both sides (the script's ``--freeze_vision`` default; TRL's optimizer, as ours, takes
only the parameters that require gradients).

TRL keeps its documented defaults otherwise; the settings we change and why:
  per_device_train_batch_size=P*G, gradient_accumulation_steps=1, num_generations=G (the batch above),
  max_completion_length=8 (TRL: 512; the task's answers are one word + EOS), learning_rate=1e-3 (TRL: 1e-6),
  loss_type="grpo" (TRL: "dapo"; the GRPO preset's aggregation), gradient_checkpointing=False (TRL: True; ours does
  not checkpoint), lr_scheduler_type="constant" (TRL: linear decay), optim="adamw_torch" (TRL: the fused variant;
  ours uses torch.optim.AdamW), bf16=False (CPU, fp32 both), report_to=[], save_strategy="no", logging_steps=1,
  use_cpu on CPU, use_vllm=False, dataloader_num_workers=0; beta 0, epsilon 0.2, temperature 1, top-p 1, top-k 0,
  scale_rewards "group", num_iterations 1 and max_grad_norm 1 are TRL's defaults, set explicitly.

A step = sample P*G completions, score, advantages, one optimizer step; tokens = completion tokens generated (up
to and including EOS). Reported: median over steps after the first of tokens / step time.

Models: ``tiny`` (always; rows ``P12-*``): the random-weight Qwen2-VL of ``tests/vision/tiny.py`` (text 32 x 2
layers, character vocabulary, vision 32 x 2) on ``TINY_ROWS`` random 32-48 px images (16-36 image tokens each) with a
length reward (``length_reward``; random weights answer nothing); ``embedded`` (when
``unialign/embedded/assets/vlm/config.json`` exists; rows ``P12-embedded-*``): the shipped warm start
(``vlm.load_embedded_vlm``) on the task above, seeds ``SEEDS`` (tokens/s pooled), plus held-out greedy accuracy
(``vlm.accuracy_reward`` on the test split, both trained models decoded by the same ``vlm.generate_answers``) after
the same number of steps, its mean over the seeds within ``ACC_TOLERANCE``. Processors are left-padded on both
sides (TRL re-runs the processor for its training forward and pads its ids on the left; a right-padded processor
misaligns ``mm_token_type_ids`` with them).

Video (rows ``P12-video-*``, when ``unialign/embedded/assets/vlm_video/config.json`` exists): TRL's GRPOTrainer
takes no video column (TRL 1.16 keeps ``prompt`` / ``image`` / ``images`` of a data set and drops the rest;
huggingface/trl#5373), so the baseline is the same model's plain generate loop: ``model.generate`` on the
processor's inputs of the same P x G prompts (each clip's prompt G times, ``videos=`` the frames), sampling at
temperature 1 / top-k 0 / top-p 1, at most L new tokens -- generation alone, the least any GRPO step must do. Ours is
a whole GRPO step of ``OnlineTrainer`` + ``VisionLanguagePolicy`` on the shipped video VLM's task
(``unialign.embedded.vlm_video``, the motion world's 5-frame clips, 48 video tokens each): sampling, scoring and the
update. Reported: completion tokens per second of each (steps interleaved, median after a warm-up step), and the
share of ours spent sampling.

    .venv/bin/python -m benchmarks.p12_vlm_grpo [--quick] [--seeds=0,1,2]   # rows as JSON
    .venv/bin/python -m benchmarks.p12_vlm_grpo --video > RUN.json   # the video row alone, a run for benchmarks.record
    .venv/bin/python -m benchmarks.run P12                     # through the suite
"""

from __future__ import annotations

import copy
import gc
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.p2_grpo import _interleave_callback, ours_step

LR = 1e-3  # scripts/grpo_vision.py's default
P_G_L = (16, 8, 8)  # prompts per step, generations per prompt, max new tokens: scripts/grpo_vision.py's defaults
THREADS = 1  # scripts/grpo_vision.py's num_threads default (tiny models: one thread is fastest)
SOLUTION = "solution"
TINY_ROWS = 256  # the tiny model's training rows (random images)
TINY_STEPS = 8  # the tiny model: throughput only
EMBEDDED_STEPS = 40  # the embedded model: throughput and held-out accuracy after these steps, per seed
SEEDS = (0, 1, 2)  # the embedded model's runs (one throughput + accuracy run each); the tiny model runs seed 0
ACC_TOLERANCE = 0.02  # |ours - TRL| of the mean held-out accuracy


def _imports():
    import datasets  # noqa: F401
    import trl  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401

    from unialign.trainers.online import OnlineConfig, OnlineTrainer  # noqa: F401
    from unialign.vision import VisionLanguagePolicy, vision_rows  # noqa: F401


def embedded_available() -> bool:
    try:
        from unialign.embedded.vlm import VLM_DIR
    except ImportError:  # the embedded VLM task is not in this checkout
        return False
    return (Path(VLM_DIR) / "config.json").exists()


def build_model(kind: str, seed: int = 0):
    """(model, processor): the shipped embedded VLM, or the tiny random-weight Qwen2-VL of ``tests/vision/tiny.py``."""
    if kind == "embedded":
        from unialign.embedded import vlm

        model, processor = vlm.load_embedded_vlm()
    else:
        from tests.vision.tiny import build

        model, processor = build("qwen2_vl", seed=seed)
        # TRL pads its prompt ids on the left and re-runs the processor for the training forward: its token-aligned
        # outputs (mm_token_type_ids) must be left-padded too, as TRL's own processor loading sets (vlm's loader does)
        processor.tokenizer.padding_side = "left"
    for name, p in model.named_parameters():  # scripts/grpo_vision.py's default --freeze_vision true, both sides
        if "visual" in name:
            p.requires_grad_(False)
    model.train()
    return model, processor


def train_rows(kind: str, n: int | None = None) -> list[dict]:
    """TRL's vision rows (the prompt's image block empty, ``image`` beside it): the embedded task's training split,
    or ``TINY_ROWS`` random images (32-48 px a side, so 16-36 image tokens) under a few questions."""
    if kind == "embedded":
        from unialign.embedded.vlm import vlm_dataset

        return vlm_dataset("train", n=n)
    from tests.vision.tiny import random_image

    rng = random.Random(0)
    questions = ("What colour is the shape?", "What shape is it?", "Describe the image.", "Is there a circle?")
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": questions[i % 4]}]}],
             "image": random_image(rng), SOLUTION: "abc"} for i in range(n or TINY_ROWS)]


def _text(completion) -> str:
    """A string as is; TRL's conversational completion ``[{"role": "assistant", "content": ...}]``: its text."""
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def length_reward(completions, solution, **kw) -> list[float]:
    """The tiny model's reward (its random weights answer nothing): minus the distance of the completion's length in
    characters (= tokens of the character tokenizer) from the solution's; a signal that varies within a group."""
    return [-abs(len(_text(c)) - len(s)) / 8.0 for c, s in zip(completions, solution)]


def reward_fn(kind: str):
    if kind == "embedded":
        from unialign.embedded.vlm import accuracy_reward

        return accuracy_reward
    return length_reward


class _TokenCountingReward:
    """The kind's reward (TRL's signature) that records how many completion tokens TRL handed it (ids up to EOS)."""

    def __init__(self, fn):
        self.fn, self.last_tokens, self.__name__ = fn, 0, fn.__name__

    def __call__(self, prompts=None, completions=None, completion_ids=None, solution=None, **kw):
        self.last_tokens = sum(len(c) for c in completion_ids) if completion_ids is not None else 0
        return self.fn(completions, solution)


# ----------------------------------------------------------------------------- builders
def make_ours(model, processor, rows, P, G, L, steps, out_dir, seed=0, reward=None):
    """Ours as ``scripts/grpo_vision.py`` builds it: ``VisionLanguagePolicy`` on the model and processor,
    ``vision_rows`` (the images into the prompts), ``OnlineTrainer`` with the GRPO preset and the settings of the
    module docstring."""
    from unialign.trainers.online import OnlineConfig, OnlineTrainer
    from unialign.vision import VisionLanguagePolicy, vision_rows

    policy = VisionLanguagePolicy(model, processor, max_new_tokens=L, temperature=1.0, top_p=1.0, top_k=0)
    cfg = OnlineConfig(algorithm="grpo", beta=0.0, num_generations=G, prompts_per_step=P, micro_batch_size=P * G,
                       num_mini_batches=1, max_steps=steps, learning_rate=LR, warmup_steps=0,
                       lr_scheduler_type="constant", max_completion_length=L, max_grad_norm=1.0, report_to="none",
                       output_dir=out_dir, seed=seed)
    return OnlineTrainer(policy, reward or reward_fn("embedded"), vision_rows(rows, "vlm train"), cfg)


def make_trl(model, processor, rows, P, G, L, steps, out_dir, callbacks=(), seed=0, reward=None, **trl_args):
    """TRL's GRPOTrainer on the same model / processor with the settings of the module docstring; ``trl_args``
    override GRPOConfig fields."""
    trl_args.setdefault("use_vllm", False)
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "image": r["image"], SOLUTION: r[SOLUTION]}
                                     for r in rows])
    cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
        max_completion_length=L, temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR, beta=0.0,
        loss_type="grpo", epsilon=0.2, scale_rewards="group", num_iterations=1, report_to=[],
        bf16=False, fp16=False, gradient_checkpointing=False, lr_scheduler_type="constant", optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=1.0, max_steps=steps, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=seed, use_cpu=not cuda, dataloader_num_workers=0, **trl_args)
    reward = _TokenCountingReward(reward or reward_fn("embedded"))
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=ds,
                          processing_class=processor, callbacks=list(callbacks))
    return trainer, reward


def held_out_accuracy(model, processor, rows) -> float:
    """Greedy accuracy of ``model`` on ``rows`` (``vlm.accuracy_reward``), decoded by ``vlm.generate_answers``: the
    same evaluation for both trained models, independent of either trainer."""
    from unialign.embedded.vlm import accuracy_reward, generate_answers

    texts = [t[0] for t in generate_answers(model, processor, rows, greedy=True)]
    return sum(accuracy_reward(texts, [r[SOLUTION] for r in rows])) / len(rows)


# ----------------------------------------------------------------------------- measurements
def throughput(kind: str, P: int, G: int, L: int, steps: int, evaluate: bool = False, eval_rows: int | None = None,
               seed: int = 0, threads: int = THREADS) -> dict:
    """Both trainers in this process, steps interleaved; with ``evaluate``, held-out greedy accuracy before and after
    (the first ``eval_rows`` test rows; None: all)."""
    torch.set_num_threads(threads)
    base, processor = build_model(kind, seed)
    rows, reward_kind = train_rows(kind), reward_fn(kind)
    res: dict = {"kind": kind, "P": P, "G": G, "L": L, "steps": steps, "threads": threads, "seed": seed,
                 "params": sum(p.numel() for p in base.parameters())}
    test = []
    if evaluate:
        from unialign.embedded.vlm import vlm_dataset

        test = vlm_dataset("test", n=eval_rows)
    if test:
        res["acc_before"] = held_out_accuracy(copy.deepcopy(base), processor, test)
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(seed)
        ours = make_ours(copy.deepcopy(base), copy.deepcopy(processor), rows, P, G, L, steps,
                         os.path.join(d, "ours"), seed, reward=reward_kind)
        trl_times, trl_tokens, ours_times, ours_tokens = [], [], [], []
        trainer, reward = make_trl(copy.deepcopy(base), copy.deepcopy(processor), rows, P, G, L, steps,
                                   os.path.join(d, "trl"), seed=seed, reward=reward_kind)
        trainer.add_callback(_interleave_callback(trl_times, trl_tokens, ours_times, ours_tokens, reward, ours))
        trainer.train()
        if test:
            res["acc_ours"] = held_out_accuracy(ours.policy.model, processor, test)
            res["acc_trl"] = held_out_accuracy(trainer.model, processor, test)
            res["eval_rows"] = len(test)
    res.update(trl_times=trl_times, trl_tokens=trl_tokens, ours_times=ours_times, ours_tokens=ours_tokens)
    res["ours_tok_s"] = common.median(_tok_s(ours_times, ours_tokens))
    res["trl_tok_s"] = common.median(_tok_s(trl_times, trl_tokens))
    res["ours_step_s"] = common.median(ours_times[1:])
    res["trl_step_s"] = common.median(trl_times[1:])
    return res


def memory_child(impl: str, kind: str, P: int, G: int, L: int, steps: int, seed: int = 0,
                 threads: int = THREADS) -> dict:
    """One trainer alone (run in a fresh process): peak RSS over ``steps`` steps minus RSS after imports and the
    training rows (the same images on both sides)."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    _imports()
    rows = train_rows(kind)
    common.rss_tracks_tensors()
    gc.collect()
    rss0 = common.rss_bytes()
    common.reset_peak_rss()
    base, processor = build_model(kind, seed)
    with tempfile.TemporaryDirectory() as d:
        {"ours": train_ours, "trl": train_trl}[impl](base, processor, rows, P, G, L, steps, d, seed, reward_fn(kind))
    peak = common.peak_rss_bytes()
    return {"impl": impl, "peak_rss_bytes": peak, "rss_after_imports": rss0, "peak_delta_bytes": peak - rss0}


def train_ours(model, processor, rows, P, G, L, steps, out_dir, seed=0, reward=None) -> None:
    """Ours alone: ``steps`` GRPO steps of ``OnlineTrainer``."""
    tr = make_ours(model, processor, rows, P, G, L, steps, out_dir, seed, reward=reward)
    for _ in range(steps):
        ours_step(tr)


def train_trl(model, processor, rows, P, G, L, steps, out_dir, seed=0, reward=None) -> None:
    """TRL alone: ``GRPOTrainer.train()`` for ``steps`` steps."""
    tr, _ = make_trl(model, processor, rows, P, G, L, steps, out_dir, seed=seed, reward=reward)
    tr.train()


def video_available() -> bool:
    try:
        from unialign.embedded.vlm_video import VLM_VIDEO_DIR
    except ImportError:
        return False
    return (Path(VLM_VIDEO_DIR) / "config.json").exists()


def generate_loop(model, processor, rows, G: int, L: int) -> int:
    """The plain loop a user would write: one ``model.generate`` over the P x G prompts (each row's G times), sampling
    (temperature 1, top-k 0, top-p 1), at most ``L`` new tokens; returns the completion tokens (up to and including
    EOS)."""
    from unialign.embedded import vlm

    prompts = [r for r in rows for _ in range(G)]
    enc = vlm.encode(processor, [vlm._question(r) for r in prompts], videos=[r["video"] for r in prompts])
    tok = processor.tokenizer
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=L,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    new = out[:, enc["input_ids"].shape[1]:]
    done = (new == tok.eos_token_id).int().cumsum(1)
    return int(((done == 0) | ((done == 1) & (new == tok.eos_token_id))).sum())


def video_throughput(P: int, G: int, L: int, steps: int, seed: int = 0, threads: int = THREADS) -> dict:
    """Ours (whole GRPO steps) and the plain generate loop on the same prompts, interleaved step by step."""
    import time

    from unialign.embedded import vlm, vlm_video

    torch.set_num_threads(threads)
    base, processor = vlm_video.load_embedded_vlm_video()
    for name, p in base.named_parameters():
        if "visual" in name:
            p.requires_grad_(False)
    base.train()
    rows = vlm_video.video_dataset("train")
    baseline_model = copy.deepcopy(base).eval()
    res: dict = {"P": P, "G": G, "L": L, "steps": steps, "threads": threads, "seed": seed}
    ours_times, ours_tokens, base_times, base_tokens, sample_times = [], [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(seed)
        ours = make_ours(copy.deepcopy(base), copy.deepcopy(processor), rows, P, G, L, steps,
                         os.path.join(d, "ours"), seed, reward=vlm.accuracy_reward)
        rng = random.Random(seed)
        for _ in range(steps):
            t0 = time.perf_counter()
            traj, _ = ours.collect()
            sample_times.append(time.perf_counter() - t0)
            ours_tokens.append(int(traj.mask_B_T.sum()) if traj is not None else 0)
            if traj is not None:
                ours.update(traj)
            ours.step += 1
            ours_times.append(time.perf_counter() - t0)
            chunk = rng.sample(rows, P)
            t0 = time.perf_counter()
            base_tokens.append(generate_loop(baseline_model, processor, chunk, G, L))
            base_times.append(time.perf_counter() - t0)
    res.update(ours_times=ours_times, ours_tokens=ours_tokens, base_times=base_times, base_tokens=base_tokens,
               sample_times=sample_times)
    res["ours_tok_s"] = common.median(_tok_s(ours_times, ours_tokens))
    res["generate_tok_s"] = common.median(_tok_s(base_times, base_tokens))
    res["ours_sampling_tok_s"] = common.median(_tok_s(sample_times, ours_tokens))
    res["sampling_share"] = common.median([s / t for s, t in zip(sample_times[1:], ours_times[1:])])
    return res


def _tok_s(times, tokens) -> list[float]:
    return [n / t for t, n in zip(times[1:], tokens[1:]) if t > 0]  # drop the warm-up step


def run(quick: bool = False, seeds: tuple[int, ...] | None = None) -> list[dict]:
    # quick: a smoke run (2 prompts x 4, 4 tokens, 2 steps, one seed, 1-step memory children, 16 held-out rows)
    P, G, L = (2, 4, 4) if quick else P_G_L
    seeds = seeds or ((0,) if quick else SEEDS)
    kinds = ["tiny"] + (["embedded"] if embedded_available() else [])
    rows = []
    for kind in kinds:
        tag = "P12" if kind == "tiny" else "P12-embedded"
        model_desc = (f"tiny random-init Qwen2-VL (tests/vision/tiny.py), {TINY_ROWS} random 32-48 px images, "
                      "length reward" if kind == "tiny" else "embedded VLM (unialign/embedded/assets/vlm), accuracy_reward")
        st = 2 if quick else (TINY_STEPS if kind == "tiny" else EMBEDDED_STEPS)
        kind_seeds = seeds if kind == "embedded" else seeds[:1]
        setting = (f"{model_desc}; P={P} prompts x G={G}, max {L} new tokens, beta=0, grpo/seq-mean-token-mean, "
                  f"lr {LR} constant, {st} steps (median of steps 2..{st}"
                  + (f", pooled over seeds {'/'.join(map(str, kind_seeds))}" if len(kind_seeds) > 1 else "")
                  + f"; interleaved in one process); CPU fp32, {THREADS} torch thread")
        try:
            runs = [throughput(kind, P, G, L, st, evaluate=kind == "embedded", eval_rows=16 if quick else None,
                               seed=seed) for seed in kind_seeds]
            ours_tps = [x for r in runs for x in _tok_s(r["ours_times"], r["ours_tokens"])]
            trl_tps = [x for r in runs for x in _tok_s(r["trl_times"], r["trl_tokens"])]
            per_seed = [r["ours_tok_s"] / r["trl_tok_s"] for r in runs]
            notes = setting + ("; per-seed ratios " + ", ".join(f"{x:.3f}" for x in per_seed) if len(runs) > 1 else "")
            rows.append(common.row(f"{tag}-tput", "VLM GRPO completion tokens/s (sample+score+update)", common.median(ours_tps),
                                   common.median(trl_tps), "tok/s", "higher", 1.3, notes,
                                   ours_step_s=common.median([t for r in runs for t in r["ours_times"][1:]]),
                                   baseline_step_s=common.median([t for r in runs for t in r["trl_times"][1:]]),
                                   per_seed_ratios=per_seed, raw=runs))
            if kind == "embedded":
                ours_acc = sum(r["acc_ours"] for r in runs) / len(runs)
                trl_acc = sum(r["acc_trl"] for r in runs) / len(runs)
                pairs = ", ".join(f"seed {r['seed']}: {r['acc_ours']:.3f} vs {r['acc_trl']:.3f}" for r in runs)
                acc = common.row(f"{tag}-acc", f"held-out greedy accuracy after {st} steps ({runs[0]['eval_rows']} rows"
                                 + (f", mean of {len(runs)} seeds)" if len(runs) > 1 else ")"), ours_acc, trl_acc, "frac",
                                 "higher", None,
                                 f"before training: {runs[0]['acc_before']:.3f}; {pairs}; target |ours - TRL| <= "
                                 f"{ACC_TOLERANCE} (the mean's difference; 'met' says so); test split, "
                                 "vlm.accuracy_reward, both models decoded by vlm.generate_answers (data order "
                                 "differs: TRL shuffles its own way)",
                                 diff=ours_acc - trl_acc, acc_tolerance=ACC_TOLERANCE,
                                 per_seed=[{"seed": r["seed"], "ours": r["acc_ours"], "trl": r["acc_trl"]} for r in runs])
                acc["met"] = abs(ours_acc - trl_acc) <= ACC_TOLERANCE
                rows.append(acc)
        except Exception as e:  # noqa: BLE001
            rows.append(common.error_row(f"{tag}-tput", "VLM GRPO completion tokens/s", e))
        mem_steps = 1 if quick else 3
        rows.append(common.peak_memory_row(
            f"{tag}-mem", "VLM GRPO", "p12_vlm_grpo", dict(kind=kind, P=P, G=G, L=L, steps=mem_steps),
            f"{model_desc}; each trainer alone in a fresh process, {mem_steps} steps; peak VmHWM minus RSS after "
            "importing both libraries and reading the rows; informative (no target)"))
    if video_available():
        rows.append(_video_row(P, G, L, 2 if quick else VIDEO_STEPS))
    return rows


VIDEO_STEPS = 12  # the video row: steps of each side (the first a warm-up)


def _video_row(P: int, G: int, L: int, steps: int) -> dict:
    try:
        r = video_throughput(P, G, L, steps)
    except Exception as e:  # noqa: BLE001
        return common.error_row("P12-video-tput", "VLM video GRPO completion tokens/s", e)
    return common.row("P12-video-tput", "VLM video GRPO step (sample+score+update) tokens/s vs the same model's plain "
                      "generate loop (generation only)", r["ours_tok_s"], r["generate_tok_s"], "tok/s", "higher", None,
                      f"embedded video VLM (unialign/embedded/assets/vlm_video), motion-world clips (5 frames 32x32, 48 "
                      f"video tokens), vlm_accuracy; P={P} x G={G}, max {L} new tokens, {steps} steps interleaved "
                      f"(median of steps 2..{steps}); ours samples in {r['sampling_share']:.0%} of its step, its "
                      f"sampling alone {r['ours_sampling_tok_s'] / r['generate_tok_s']:.2f}x the loop's tokens/s; TRL's "
                      "GRPOTrainer takes no video column (TRL 1.16: prompt / image / images), so the baseline is "
                      "model.generate on the same prompts and clips; informative (no target); CPU fp32, "
                      f"{THREADS} torch thread", ours_step_s=common.median(r["ours_times"][1:]),
                      baseline_step_s=common.median(r["base_times"][1:]), sampling_share=r["sampling_share"],
                      ours_sampling_tok_s=r["ours_sampling_tok_s"], raw=r)


if __name__ == "__main__":
    import json

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    seeds = next((tuple(int(x) for x in a.split("=", 1)[1].split(",")) for a in sys.argv if a.startswith("--seeds=")),
                 None)
    if "--video" in sys.argv:  # the video row alone, as a run benchmarks.record takes
        import contextlib
        import time

        date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with contextlib.redirect_stdout(sys.stderr):  # the policy's notices: stdout is the run's JSON
            video = _video_row(*P_G_L, VIDEO_STEPS)
        print(json.dumps({"machine": common.machine_info(), "date": date, "mode": "default", "rows": [video],
                          "command": "python -m benchmarks.p12_vlm_grpo --video"}, indent=1, default=str))
    else:
        print(json.dumps(run(quick="--quick" in sys.argv, seeds=seeds), indent=1, default=str))
