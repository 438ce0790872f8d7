"""Benchmark P14: the Wan 2.1 family (``FlowPolicyBase`` with ``WanFamily``, Flow-GRPO's SDE sampler on 5-D latents) on
a small Wan-architecture model built in code (random weights, no downloads).

Model (``components``): ``WanTransformer3DModel`` with 4 blocks, 4 heads x 32 (inner width 128), patch 1 x 2 x 2,
16 latent channels (Wan 2.1's), 17 frames of 64 x 64 pixels = 5 x 8 x 8 latents (80 video tokens); a 2-layer
``UMT5EncoderModel`` (width 32) on ``sd_parts``' byte-level tokenizer, 16 text tokens; a tiny ``AutoencoderKLWan``
with Wan 2.1's 16 latent channels and its 8x / 4x factors; ``FlowMatchEulerDiscreteScheduler(shift=3.0)``
(Wan 2.1's ``flow_shift`` at 480p).

P14a, sampling overhead: ``FlowPolicyBase.sample`` (the Flow-GRPO "sde" step with eta 0.7 on every step; every
latent and per-step log-prob recorded) vs diffusers' stock ``WanPipeline`` on the SAME modules (its scheduler a
copy with the same config), same N steps, CFG 5 (WanPipeline calls the transformer twice a step, the policy once on a
doubled batch), batch, size and frames; both decode to frames (the pipeline with ``output_type="pil"``). Median
wall time of ``repeats`` calls each, interleaved after one warm-up call each. Target: ours / stock <= 1.03.
Checked on the way (the notes): as eta -> 0 the policy's clean latents approach the stock pipeline's from the
same initial noise (the largest difference at eta 1e-3, what "the same frames for the same seed" means for a
stochastic sampler: its own noise is the only difference).

The GPU row ``G-P14a`` (``benchmarks/gpu.py``) runs the same comparison at Wan2.1-T2V-1.3B's transformer
dimensions (30 blocks, 12 heads x 128, ffn 8960, text width 4096; random weights) at 33 frames of 480 x 832.
"""

from __future__ import annotations

import functools
import gc
import sys
import time

import torch

from benchmarks import common, sd_parts

THREADS = 1
SIZE = dict(num_layers=4, num_attention_heads=4, attention_head_dim=32, height=64, width=64, frames=17)
SAMPLING = dict(steps=10, guidance=5.0, noise_level=0.7, batch=2)
TEXT_TOKENS = 16
# Wan2.1-T2V-1.3B's transformer (its config.json), for the GPU row
WAN_1_3B = dict(num_layers=30, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, text_dim=4096,
                freq_dim=256)


def components(seed: int = 0, num_layers: int = 4, num_attention_heads: int = 4, attention_head_dim: int = 32,
               ffn_dim: int | None = None, text_dim: int = 32, freq_dim: int = 64, **_: object) -> dict:
    """The parts of a ``WanPipeline`` (keyword names of its constructor), random weights."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    inner = num_attention_heads * attention_head_dim
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
        in_channels=16, out_channels=16, text_dim=text_dim, freq_dim=freq_dim, ffn_dim=ffn_dim or 2 * inner,
        num_layers=num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=520, d_model=text_dim, d_kv=8, d_ff=2 * text_dim, num_layers=2,
                                          num_heads=2, relative_attention_num_buckets=8)).eval()
    return dict(transformer=transformer, vae=vae, text_encoder=encoder, tokenizer=sd_parts.tokenizer(),
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def policy_and_pipeline(steps: int, guidance: float, noise_level: float, seed: int = 0, height: int = 64,
                        width: int = 64, frames: int = 17, device: str = "cpu", dtype=None, **size):
    """(``FlowPolicyBase(family=WanFamily)``, stock ``WanPipeline``) sharing every module; the pipeline gets its own
    scheduler with the same config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from unialign.image.flow_policy import FlowPolicyBase
    from unialign.image.wan import WanFamily

    parts = components(seed, **size)
    if dtype is not None:
        parts["transformer"].to(dtype)
        parts["text_encoder"].to(dtype)
    for name in ("transformer", "vae", "text_encoder"):
        parts[name].to(device)
    policy = FlowPolicyBase(**parts, family=WanFamily, num_steps=steps, guidance_scale=guidance,
                            noise_level=noise_level, max_sequence_length=TEXT_TOKENS, height=height, width=width,
                            num_frames=frames)
    pipe = WanPipeline(transformer=policy.transformer, vae=policy.vae, text_encoder=policy.text_encoder,
                       tokenizer=policy.tokenizer,
                       scheduler=FlowMatchEulerDiscreteScheduler.from_config(policy.scheduler.config))
    pipe.set_progress_bar_config(disable=True)
    return policy, pipe


def sample_ours(policy, prompts, seed):
    """Ours: one ``sample`` call (SDE steps, every latent and log-prob recorded, frames decoded)."""
    return policy.sample(prompts, generator=torch.Generator().manual_seed(seed))


def sample_stock(pipe, policy, prompts, steps, guidance, seed, **extra):
    """Baseline: one call of the stock ``WanPipeline`` on the same modules (Euler, frames as PIL)."""
    return pipe(prompts, num_inference_steps=steps, guidance_scale=guidance, height=policy.height,
                width=policy.width, num_frames=policy.knobs.num_frames, max_sequence_length=TEXT_TOKENS,
                output_type=extra.pop("output_type", "pil"), generator=torch.Generator().manual_seed(seed), **extra)


@torch.no_grad()
def eta_gaps(steps: int, guidance: float, seed: int = 0, **size) -> dict[str, float]:
    """Largest |clean latent (ours) - clean latent (stock)| from the same initial noise at eta 1e-1 and 1e-3."""
    out = {}
    for eta in (1e-1, 1e-3):
        policy, pipe = policy_and_pipeline(steps, guidance, eta, seed, **size)
        prompts = sd_parts.PROMPTS[:2]
        traj = policy.sample(prompts, generator=torch.Generator().manual_seed(seed))
        stock = sample_stock(pipe, policy, prompts, steps, guidance, seed, output_type="latent",
                             latents=traj.payload["latents"][:, 0]).frames
        out[f"{eta:g}"] = float((traj.payload["latents"][:, -1] - stock.float()).abs().max())
    return out


def measure_sampling(batch: int = 2, steps: int = 10, guidance: float = 5.0, noise_level: float = 0.7,
                     repeats: int = 10, seed: int = 0, sync=lambda: None, **size) -> dict:
    """Interleaved wall times of ``policy.sample`` and the stock pipeline (both decode to frames); raw dict."""
    policy, pipe = policy_and_pipeline(steps, guidance, noise_level, seed, **size)
    prompts = (sd_parts.PROMPTS * 8)[:batch]
    ours = functools.partial(sample_ours, policy, prompts, seed)
    stock = functools.partial(sample_stock, pipe, policy, prompts, steps, guidance, seed)
    with torch.no_grad():
        traj, frames = ours(), stock().frames  # warm-up both
        sync()
        times = {"ours": [], "stock": []}
        for i in range(repeats):
            for name, fn in ((("ours", ours), ("stock", stock)) if i % 2 == 0 else (("stock", stock), ("ours", ours))):
                gc.collect()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
    return {"ours_s": common.median(times["ours"]), "stock_s": common.median(times["stock"]), "times": times,
            "pair_ratio_median": common.median([a / b for a, b in zip(times["ours"], times["stock"])]),
            "ours_min_s": min(times["ours"]), "stock_min_s": min(times["stock"]),
            "latents_shape": list(traj.payload["latents"].shape), "recorded_logp_shape": list(traj.old_logp_B_T.shape),
            "frames": [len(traj.completions[0]), len(frames[0])],
            "transformer_params": sum(p.numel() for p in policy.transformer.parameters())}


def p14a_rows(quick: bool) -> list[dict]:
    s = SAMPLING
    repeats = 2 if quick else 10
    try:
        r = measure_sampling(batch=s["batch"], steps=s["steps"], guidance=s["guidance"], noise_level=s["noise_level"],
                             repeats=repeats, **SIZE)
        gaps = eta_gaps(4, s["guidance"], **SIZE)
        b, n, c, f, h, w = r["latents_shape"]
        notes = (f"WanTransformer3DModel {SIZE['num_layers']} blocks, {SIZE['num_attention_heads']} heads x "
                 f"{SIZE['attention_head_dim']}, patch 1x2x2, {c}x{f}x{h}x{w} latents of {SIZE['frames']} frames at "
                 f"{SIZE['height']}x{SIZE['width']} ({f * h * w // 4} video + {TEXT_TOKENS} text tokens), "
                 f"{r['transformer_params'] / 1e6:.2f}M params, tiny UMT5 and Wan VAE; {s['steps']} steps, Flow-GRPO sde "
                 f"eta {s['noise_level']} on all steps vs stock Euler, CFG {s['guidance']} (stock: two calls a step; "
                 f"ours: one doubled batch), batch {s['batch']}, both decode to frames; median of {repeats} "
                 f"interleaved calls after warm-up; CPU fp32, {torch.get_num_threads()} thread(s); noise check: "
                 f"min-time ratio {r['ours_min_s'] / r['stock_min_s']:.3f}, median of per-pair ratios "
                 f"{r['pair_ratio_median']:.3f}; same initial noise, largest clean-latent gap to stock at eta 0.1 / "
                 f"0.001: {gaps['0.1']:.2e} / {gaps['0.001']:.2e}")
        return [common.row("P14a", "Wan sampling wall time (ours records per-step SDE log-probs)", r["ours_s"],
                           r["stock_s"], "s", "lower", 1.03, notes, raw={**r, "eta_gaps": gaps})]
    except Exception as e:  # noqa: BLE001
        return [common.error_row("P14a", "Wan sampling wall time", e)]


def run(quick: bool = False) -> list[dict]:
    """The P14a row on ``THREADS`` torch threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return p14a_rows(quick)
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=1, default=str))

