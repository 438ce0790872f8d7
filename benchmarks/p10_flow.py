"""Benchmark P10: the SD3 family (``FlowMatchingPolicy``, Flow-GRPO's SDE sampler) on a small SD3-architecture
transformer built in code (random weights, no downloads).

Model (``components``): ``SD3Transformer2DModel`` with 4 joint blocks, 4 heads x 32 (inner width 128), patch 2,
16 latent channels, 32x32 latents (256 image tokens) + 16 CLIP + 16 zero "T5" tokens (``text_encoder_3=None``,
as the stock pipeline allows), 2.3M parameters; two tiny CLIP text encoders with projection (CLIP-L / CLIP-G
stand-ins, hidden 32 each: joint width 64, pooled 64); a tiny VAE with SD3's 16 latent channels, scaling and
shift factors (scale factor 2: 64x64-pixel images); ``FlowMatchEulerDiscreteScheduler(shift=3.0)`` (SD3's
config). On one CPU thread a CFG transformer call at batch 4 takes ~60 ms, ~95 % of a sampling call (the
rest: text encoders, VAE decode, the step maths); SD3-medium (24 blocks, width 1536, 4096 image tokens at
1024 px) is far more transformer-bound still.

P10a, sampling overhead: ``FlowMatchingPolicy.sample`` (every step the Flow-GRPO "sde" step with eta 0.7,
the default; every latent and per-step log-prob recorded; no window, so all N steps are stochastic) vs
diffusers' stock ``StableDiffusion3Pipeline`` built from the SAME transformer / VAE / text encoders /
tokenizers (its scheduler a copy with the same config), same N steps, CFG 4.5 (one doubled batch per step
on both), batch, image size and ``max_sequence_length``; both VAE-decode to PIL (the pipeline with
``output_type="pil"``). The pipeline encodes the empty negative prompt on every call; ours caches it.
Median wall time of ``repeats`` calls each, interleaved (ours, stock, stock, ours, ...) after one warm-up
call each. Target: ours / stock <= 1.03. Noise checks in the notes (the box is shared): the ratio of the
fastest calls, the median of per-pair ratios, the process-CPU-time ratio, and each call's time outside the
transformer's forward (forward hooks; the transformer work is identical on both sides, so the sampler's own
cost is what differs).

P10b, what the SDE window saves in training: the time of one GRPO step through the unchanged
``OnlineTrainer.train_step`` (sample P x G images, score, advantages, one optimizer step over all trained
steps; 2 prompts x 2 images, N = 10) with ``sde_window_size=2`` vs 0 (all N steps stochastic and trained),
same N, everything else equal (LoRA r8 on SD3's attention projections as Flow-GRPO trains, beta 0, one
micro-batch, all trained steps in one forward / backward: ``train_chunk_size`` 0). The two trainers run in one process on two copies of the
same initial weights, steps interleaved (ABBA), after one warm-up step each (the first update's ratio-1
check). Reported: median step time, split into sampling (``collect``: sampling, scoring, advantages) and the
update. Memory: after the timed steps glibc is told to ``mmap`` large blocks (freed tensors leave the resident
set, ``common.rss_tracks_tensors``) and each side runs more steps, interleaved, each with the peak RSS
(VmHWM, reset before the step) minus the RSS at the step's start: the step's working memory (sampling
buffers, the update's activations and gradients); median. Both ratios are informative (no target).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import gc
import sys
import tempfile
import time

import torch

from benchmarks import common, sd_parts

# the transformer (see the module docstring); TEXT_TOKENS: the zero "T5" block's length (max_sequence_length)
SIZE = dict(sample_size=32, num_layers=4, num_attention_heads=4, attention_head_dim=32)
TEXT_TOKENS = 16
CLIP_HIDDEN = 32
THREADS = 1  # one torch thread for both rows (the machine is shared; the ratios are what is compared)
SAMPLING = dict(steps=10, guidance=4.5, noise_level=0.7, batch=4)
TRAINING = dict(steps=10, window=2, prompts=2, per_prompt=2, lora_rank=8, lr=1e-4)


# ----------------------------------------------------------------------------- components
def clip_with_projection(hidden: int = CLIP_HIDDEN, projection: int = CLIP_HIDDEN):
    """A tiny ``CLIPTextModelWithProjection`` on ``sd_parts``' byte-level vocabulary (SD3's CLIP-L / CLIP-G role)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=520, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                         num_hidden_layers=2, max_position_embeddings=sd_parts.MAX_LEN, projection_dim=projection,
                         bos_token_id=sd_parts.BOS, eos_token_id=sd_parts.EOS, pad_token_id=sd_parts.EOS,
                         hidden_act="gelu")
    return CLIPTextModelWithProjection(cfg).eval()


def sd3_vae():
    """A tiny ``AutoencoderKL`` with SD3's 16 latent channels, scaling 1.5305 and shift 0.0609 (scale factor 2)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=16,
                         norm_num_groups=4, layers_per_block=1, sample_size=32, scaling_factor=1.5305,
                         shift_factor=0.0609)


def components(seed: int = 0, sample_size: int = 16, num_layers: int = 4, num_attention_heads: int = 4,
               attention_head_dim: int = 32) -> dict:
    """The parts of a ``StableDiffusion3Pipeline`` without T5 (keyword names of its constructor)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    torch.manual_seed(seed)
    inner = num_attention_heads * attention_head_dim
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=16, out_channels=16, num_layers=num_layers,
        attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
        joint_attention_dim=2 * CLIP_HIDDEN, caption_projection_dim=inner, pooled_projection_dim=2 * CLIP_HIDDEN,
        pos_embed_max_size=sample_size // 2)
    return dict(transformer=transformer, vae=sd3_vae(), text_encoder=clip_with_projection(),
                tokenizer=sd_parts.tokenizer(), text_encoder_2=clip_with_projection(), tokenizer_2=sd_parts.tokenizer(),
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def policy_and_pipeline(steps: int, guidance: float, noise_level: float, seed: int = 0, **size):
    """(``FlowMatchingPolicy``, stock ``StableDiffusion3Pipeline``) sharing every module; the pipeline gets its
    own scheduler with the same config (its ``set_timesteps`` / step index must not touch the policy's)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from unialign.image.flow_policy import FlowMatchingPolicy

    parts = components(seed, **size)
    policy = FlowMatchingPolicy(**parts, num_steps=steps, guidance_scale=guidance, noise_level=noise_level,
                                max_sequence_length=TEXT_TOKENS)
    pipe = StableDiffusion3Pipeline(
        transformer=policy.transformer, vae=policy.vae, text_encoder=policy.text_encoder, tokenizer=policy.tokenizer,
        text_encoder_2=policy.text_encoder_2, tokenizer_2=policy.tokenizer_2, text_encoder_3=None, tokenizer_3=None,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(policy.scheduler.config))
    pipe.set_progress_bar_config(disable=True)
    return policy, pipe


# ----------------------------------------------------------------------------- P10a
def sample_ours(policy, prompts, seed):
    """Ours: one ``FlowMatchingPolicy.sample`` call (SDE steps, every latent and log-prob recorded, PIL images)."""
    return policy.sample(prompts, generator=torch.Generator().manual_seed(seed))


def sample_stock(pipe, prompts, steps, guidance, height, width, seed):
    """Baseline: one call of the stock ``StableDiffusion3Pipeline`` on the same modules (Euler, PIL images)."""
    return pipe(prompts, num_inference_steps=steps, guidance_scale=guidance, height=height,
                width=width, max_sequence_length=TEXT_TOKENS, output_type="pil",
                generator=torch.Generator().manual_seed(seed))


def measure_sampling(batch: int = 4, steps: int = 10, guidance: float = 4.5, noise_level: float = 0.7,
                     repeats: int = 10, seed: int = 0, **size) -> dict:
    """Interleaved wall times of ``policy.sample`` and the stock pipeline (both decode to PIL); raw dict."""
    policy, pipe = policy_and_pipeline(steps, guidance, noise_level, seed, **size)
    prompts = (sd_parts.PROMPTS * 8)[:batch]
    ours = functools.partial(sample_ours, policy, prompts, seed)
    stock = functools.partial(sample_stock, pipe, prompts, steps, guidance, policy.height, policy.width, seed)

    # wall time spent inside the transformer's forward (same work on both sides): a call minus it is the
    # sampler's own cost (text encoders, step maths, recording, VAE decode, Python), timed in the same window
    in_model = {"s": 0.0, "t0": 0.0}
    hooks = [policy.transformer.register_forward_pre_hook(lambda *_: in_model.update(t0=time.perf_counter())),
             policy.transformer.register_forward_hook(
                 lambda *_: in_model.update(s=in_model["s"] + time.perf_counter() - in_model["t0"]))]
    try:
        with torch.no_grad():
            traj, images = ours(), stock().images  # warm-up both
            times, cpu, model = ({"ours": [], "stock": []} for _ in range(3))
            for i in range(repeats):
                order = (("ours", ours), ("stock", stock)) if i % 2 == 0 else (("stock", stock), ("ours", ours))
                for name, fn in order:
                    gc.collect()
                    in_model["s"] = 0.0
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
                    model[name].append(in_model["s"])
    finally:
        for h in hooks:
            h.remove()
    outside = {k: [a - b for a, b in zip(times[k], model[k])] for k in times}
    return {"ours_s": common.median(times["ours"]), "stock_s": common.median(times["stock"]), "times": times,
            "ours_min_s": min(times["ours"]), "stock_min_s": min(times["stock"]),
            "pair_ratio_median": common.median([a / b for a, b in zip(times["ours"], times["stock"])]),
            "cpu_s": cpu, "cpu_ratio": common.median(cpu["ours"]) / common.median(cpu["stock"]),
            "transformer_s": model, "transformer_share": common.median([b / a for a, b in zip(times["stock"], model["stock"])]),
            "outside_transformer_s": {k: common.median(v) for k, v in outside.items()}, "recorded_logp_shape": list(traj.old_logp_B_T.shape),
            "latents_shape": list(traj.payload["latents"].shape), "images": [len(traj.completions), len(images)],
            "image_size": list(traj.completions[0].size),
            "transformer_params": sum(p.numel() for p in policy.transformer.parameters()),
            "latent_hw": policy.height // policy.vae_scale_factor}


def p10a_rows(quick: bool) -> list[dict]:
    s = SAMPLING
    repeats = 2 if quick else 10  # even: each side goes first equally often
    try:
        r = measure_sampling(batch=s["batch"], steps=s["steps"], guidance=s["guidance"], noise_level=s["noise_level"],
                             repeats=repeats, **SIZE)
        notes = (f"SD3Transformer2DModel 4 joint blocks, 4 heads x 32, patch 2, {r['latent_hw']}x{r['latent_hw']}x16 "
                 f"latents ({(r['latent_hw'] // 2) ** 2} image + {sd_parts.MAX_LEN + TEXT_TOKENS} text tokens), "
                 f"{r['transformer_params'] / 1e6:.2f}M params, no T5 (zeros), "
                 f"tiny CLIP-L/G and VAE; {s['steps']} steps, Flow-GRPO sde eta {s['noise_level']} on all steps vs "
                 f"stock Euler, CFG {s['guidance']}, batch {s['batch']}, both decode to PIL; median of {repeats} "
                 f"interleaved calls after warm-up; CPU fp32, {torch.get_num_threads()} thread(s); the transformer "
                 f"forward is {r['transformer_share']:.1%} of a stock call; outside the transformer (text encoders, step "
                 f"maths, recording, decode) ours {r['outside_transformer_s']['ours'] * 1e3:.1f} ms vs stock "
                 f"{r['outside_transformer_s']['stock'] * 1e3:.1f} ms a call (medians); noise check: min-time ratio "
                 f"{r['ours_min_s'] / r['stock_min_s']:.3f}, median of per-pair ratios {r['pair_ratio_median']:.3f}, "
                 f"process CPU-time ratio (medians) {r['cpu_ratio']:.3f}")
        return [common.row("P10a", "SD3 sampling wall time (ours records per-step SDE log-probs)", r["ours_s"], r["stock_s"],
                           "s", "lower", 1.03, notes, raw=r)]
    except Exception as e:  # noqa: BLE001
        return [common.error_row("P10a", "SD3 sampling wall time", e)]


# ----------------------------------------------------------------------------- P10b
def _brightness(prompts, completions, **_):
    """Reward: mean pixel value in [0, 1] (cheap; the reward is not what is timed)."""
    import numpy as np

    return [float(np.asarray(im).mean() / 255) for im in completions]


def _trainer(window: int, steps: int, prompts: int, per_prompt: int, lora_rank: int, lr: float, out_dir: str,
             parts: dict, guidance: float, noise_level: float):
    from unialign.image.flow_policy import FlowMatchingPolicy
    from unialign.trainers import OnlineConfig, OnlineTrainer

    policy = FlowMatchingPolicy(**parts, num_steps=steps, guidance_scale=guidance, noise_level=noise_level,
                                max_sequence_length=TEXT_TOKENS, sde_window_size=window, lora_rank=lora_rank)
    cfg = OnlineConfig(algorithm="grpo", num_generations=per_prompt, prompts_per_step=prompts,
                       micro_batch_size=prompts * per_prompt, num_mini_batches=1, max_steps=10**6, learning_rate=lr,
                       beta=0.0, seed=0, report_to="none", output_dir=out_dir, num_threads=torch.get_num_threads())
    rows = [{"prompt": p} for p in sd_parts.PROMPTS]
    return OnlineTrainer(policy, _brightness, rows, cfg)


def _timed_step(trainer, memory: bool = False) -> dict:
    """One ``train_step`` split into collect (sample, score, advantages) and update, by wrapping ``collect``.
    ``memory``: also the peak RSS over the RSS at the step's start, of the whole step and of collect alone."""
    inner, spent = trainer.collect, {}

    def collect():
        t0 = time.perf_counter()
        try:
            return inner()
        finally:
            spent["collect"] = time.perf_counter() - t0
            if memory:
                spent["collect_peak"] = common.peak_rss_bytes()

    trainer.collect = collect
    try:
        gc.collect()
        if memory:
            _malloc_trim()
            start = common.rss_bytes()
            common.reset_peak_rss()
        t0 = time.perf_counter()
        stats = trainer.train_step()
        total = time.perf_counter() - t0
    finally:
        del trainer.collect  # back to the class's method
    if "loss" not in stats:
        raise RuntimeError(f"the step trained nothing (no group with reward spread): {stats}")
    out = {"step_s": total, "collect_s": spent["collect"], "update_s": total - spent["collect"],
           "trained_steps": float(stats.get("completion_length", float("nan")))}
    if memory:
        out.update(mem_bytes=common.peak_rss_bytes() - start, collect_mem_bytes=spent["collect_peak"] - start)
    return out


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover
        pass


def measure_training(steps: int = 10, window: int = 2, prompts: int = 2, per_prompt: int = 2, lora_rank: int = 8,
                     lr: float = 1e-4, repeats: int = 4, mem_repeats: int = 2, guidance: float = 4.5,
                     noise_level: float = 0.7, seed: int = 0, **size) -> dict:
    """GRPO step times (and per-step working memory) with ``sde_window_size=window`` vs 0; raw dict."""
    base_parts = components(seed, **size)
    res: dict = {"window": {"times": [], "mem": []}, "all": {"times": [], "mem": []}}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            name: _trainer(w, steps, prompts, per_prompt, lora_rank, lr, f"{tmp}/{name}", copy.deepcopy(base_parts),
                           guidance, noise_level)
            for name, w in (("window", window), ("all", 0))}
        for name in ("window", "all"):  # warm-up (the first update's ratio-1 check)
            res[name]["warmup"] = _timed_step(trainers[name])
        for i in range(repeats):
            for name in (("window", "all") if i % 2 == 0 else ("all", "window")):
                res[name]["times"].append(_timed_step(trainers[name]))
        common.rss_tracks_tensors()
        _malloc_trim()
        for i in range(mem_repeats):
            for name in (("window", "all") if i % 2 == 0 else ("all", "window")):
                res[name]["mem"].append(_timed_step(trainers[name], memory=True))
    out = {"transformer_params": sum(p.numel() for p in trainers["all"].policy.transformer.parameters()),
           "lora_params": sum(p.numel() for p in trainers["all"].policy.trainable_parameters())}
    for name in ("window", "all"):
        t = res[name]["times"]
        out[name] = {key: common.median([x[key] for x in t]) for key in ("step_s", "collect_s", "update_s", "trained_steps")}
        m = res[name]["mem"]
        out[name].update(steps=t, warmup=res[name]["warmup"], mem_bytes=common.median([x["mem_bytes"] for x in m]),
                         collect_mem_bytes=common.median([x["collect_mem_bytes"] for x in m]), mem_steps=m)
    out["pair_ratio_median"] = common.median([a["step_s"] / b["step_s"] for a, b in zip(res["window"]["times"],
                                                                                   res["all"]["times"])])
    return out


def p10b_rows(quick: bool) -> list[dict]:
    s = TRAINING
    repeats, mem_repeats = (2, 1) if quick else (4, 2)  # even: each side goes first equally often
    try:
        r = measure_training(steps=s["steps"], window=s["window"], prompts=s["prompts"], per_prompt=s["per_prompt"],
                             lora_rank=s["lora_rank"], lr=s["lr"], repeats=repeats, mem_repeats=mem_repeats,
                             guidance=SAMPLING["guidance"], noise_level=SAMPLING["noise_level"], **SIZE)
        w, a = r["window"], r["all"]
        batch = s["prompts"] * s["per_prompt"]
        setting = (f"the P10a transformer, LoRA r{s['lora_rank']} ({r['lora_params'] / 1e3:.0f}k params); "
                   f"OnlineTrainer.train_step (sample + score + one GRPO update, beta 0, one micro-batch, all trained "
                   f"steps in one forward/backward), {s['prompts']} prompts x {s['per_prompt']} = {batch} images, "
                   f"{s['steps']} steps, CFG {SAMPLING['guidance']}, eta {SAMPLING['noise_level']}; "
                   f"sde_window_size {s['window']} vs 0 (trained steps per image {w['trained_steps']:.0f} vs "
                   f"{a['trained_steps']:.0f}); CPU fp32, {torch.get_num_threads()} thread(s)")
        time_notes = (f"{setting}; median of {repeats} interleaved steps after a warm-up each; sampling "
                      f"{w['collect_s']:.3f} vs {a['collect_s']:.3f} s, update {w['update_s']:.3f} vs "
                      f"{a['update_s']:.3f} s (update ratio {w['update_s'] / a['update_s']:.3f}); median of per-pair "
                      f"ratios {r['pair_ratio_median']:.3f}; informative (what the window saves)")
        mib = 2.0**20
        mem_notes = (f"{setting}; peak RSS (VmHWM, reset per step, glibc mmaps blocks >= 256 KiB) minus RSS at the "
                     f"step's start, median of {mem_repeats} interleaved steps per side after the timed ones; of it "
                     f"sampling alone {w['collect_mem_bytes'] / mib:.0f} vs {a['collect_mem_bytes'] / mib:.0f} MiB; "
                     f"informative")
        return [common.row("P10b-time", "GRPO step time, SDE window 2 vs all steps", w["step_s"], a["step_s"], "s", "lower",
                           None, time_notes, raw=r),
                common.row("P10b-mem", "GRPO step working memory, SDE window 2 vs all steps", w["mem_bytes"], a["mem_bytes"],
                           "bytes", "lower", None, mem_notes)]
    except Exception as e:  # noqa: BLE001
        return [common.error_row("P10b", "GRPO step, SDE window vs all steps", e)]


def run(quick: bool = False, rows: str = "ab") -> list[dict]:
    """P10a and / or P10b rows, on ``THREADS`` torch threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return (p10a_rows(quick) if "a" in rows else []) + (p10b_rows(quick) if "b" in rows else [])
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    import json

    which = next((x.split("=", 1)[1] for x in sys.argv[1:] if x.startswith("--rows=")), "ab")
    print(json.dumps(run(quick="--quick" in sys.argv, rows=which), indent=1, default=str))
