"""Benchmark P5: Diffusion-DPO peak memory, reference = the LoRA policy's UNet with adapters disabled
(``DiffusionPolicy.reference()``, ours) vs a second frozen UNet copy (the usual recipe, baseline).

Both sides train the same LoRA (rank 8 on the attention projections) with the same Diffusion-DPO loss
(``algos.dpo_loss`` sigmoid on the ``sequence_log_prob`` ELBO surrogate, beta 5000 as in Wallace et
al.), same pairs of latents, timesteps and noise, AdamW on the LoRA weights, ``steps`` optimizer steps.
The only difference is where the reference forward runs. Each side runs alone in a fresh process;
memory = peak RSS (VmHWM) minus RSS after imports and the frozen text encoder / VAE / data (CPU), or
``torch.cuda.max_memory_allocated`` (GPU). The UNet (block_out_channels (128, 256, 512), 268 MiB,
16x16 latents, 2 pairs, gradient checkpointing on both sides) is sized so that its weights dominate,
as they do at real size. Loss check: at initialisation LoRA's B is 0,
so policy == reference and both losses must be ln 2, identical.
"""

from __future__ import annotations

import copy
import gc
import math
import sys

import torch

from benchmarks import common, sd_parts

BETA = 5000.0


def _warm_up(te, vae, tok, sched, cross_attention_dim, device):
    """One LoRA Diffusion-DPO step on a tiny UNet, so that lazily imported modules (peft), oneDNN primitives and
    thread pools are resident before the RSS baseline is taken (else they count as 'peak')."""
    from unialign.image import DiffusionPolicy
    from unialign.types import PreferenceBatch

    u = sd_parts.unet((32, 64), 8, cross_attention_dim, layers_per_block=1).to(device)
    pol = DiffusionPolicy(u, vae, te, tok, sched, num_steps=4, guidance_scale=1.0, eta=1.0, lora_rank=4)
    z = torch.randn(1, 4, 8, 8)
    b = PreferenceBatch(prompts=["a cat"], chosen={"latents": z}, rejected={"latents": z}, margin_B=None,
                        payload={"timesteps": torch.tensor([10]), "noise": z})
    c, _ = pol.sequence_log_prob(b)
    with torch.no_grad():
        pol.reference().sequence_log_prob(b)
    c.sum().backward()
    del u, pol, z, b, c
    gc.collect()


def policy_and_reference_ours(unet, make_policy):
    """Ours: the LoRA policy, and as reference the same UNet with its adapters disabled (``policy.reference()``)."""
    policy = make_policy(unet)
    return policy, policy.reference()


def policy_and_reference_copy(unet, make_policy):
    """Baseline: a frozen deep copy of the UNet taken before LoRA is added, as the reference (the usual recipe)."""
    from unialign.policy import ReferencePolicy

    frozen = copy.deepcopy(unet).requires_grad_(False).eval()
    policy = make_policy(unet)
    return policy, ReferencePolicy(policy, frozen)


def dpo_child(impl: str, block_out_channels=(64, 128, 256), sample_size=16, pairs=2, steps=2, lora_rank=8,
              cross_attention_dim=64, device="cpu", seed=0, gradient_checkpointing=True) -> dict:
    """``steps`` LoRA Diffusion-DPO steps with the reference of ``impl`` ("ours" or "copy"), alone in this (fresh)
    process: peak memory over the baseline taken before the UNet is built, the losses."""
    from unialign import algos
    from unialign.image import DiffusionPolicy
    from unialign.policy import ReferencePolicy  # noqa: F401  (both sides import it before the baseline)
    from unialign.types import PreferenceBatch

    cuda = device.startswith("cuda")
    if not cuda:
        common.rss_tracks_tensors()
    torch.manual_seed(seed)
    te, vae, tok = sd_parts.text_encoder(cross_attention_dim).to(device), sd_parts.vae().to(device), sd_parts.tokenizer()
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(**sd_parts.SD15_SCHEDULER)
    g = torch.Generator().manual_seed(seed)
    shape = (pairs, 4, sample_size, sample_size)
    data = {"chosen": torch.randn(shape, generator=g), "rejected": torch.randn(shape, generator=g),
            "t": torch.randint(0, 1000, (pairs,), generator=g), "noise": torch.randn(shape, generator=g)}
    prompts = (sd_parts.PROMPTS * 4)[:pairs]
    _warm_up(te, vae, tok, sched, cross_attention_dim, device)  # code pages, peft import, kernels: before the baseline
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base0 = torch.cuda.memory_allocated()
    else:
        base0 = common.rss_bytes()
        common.reset_peak_rss()
    torch.manual_seed(seed + 1)
    unet = sd_parts.unet(block_out_channels, sample_size, cross_attention_dim).to(device)

    def make_policy(u):
        return DiffusionPolicy(u, vae, te, tok, sched, num_steps=10, guidance_scale=1.0, eta=1.0,
                               lora_rank=lora_rank, seed=seed, gradient_checkpointing=gradient_checkpointing)

    policy, ref = {"ours": policy_and_reference_ours, "copy": policy_and_reference_copy}[impl](unet, make_policy)
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-4)
    losses = []
    for _ in range(steps):
        batch = PreferenceBatch(prompts=prompts, chosen={"latents": data["chosen"]},
                                rejected={"latents": data["rejected"]}, margin_B=None,
                                payload={"timesteps": data["t"], "noise": data["noise"]})
        c, r = policy.sequence_log_prob(batch)
        rc, rr = ref.sequence_log_prob(batch)
        loss_B, _, _ = algos.dpo_loss(c, r, rc.detach(), rr.detach(), BETA, "sigmoid", 0.0)
        loss = loss_B.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base0
    else:
        peak = common.peak_rss_bytes() - base0
    return {"impl": impl, "peak_bytes": peak, "losses": losses,
            "unet_bytes": sum(p.numel() * p.element_size() for n, p in unet.named_parameters() if "lora" not in n),
            "lora_params": sum(p.numel() for p in params), "method": "cuda.max_memory_allocated" if cuda else "VmHWM-RSS0"}


def run(quick: bool = False) -> list[dict]:
    # weights must dominate as they do at real size (SD1.5's UNet: 3.4 GB fp32); with (64, 128, 256) (67 MiB)
    # ~40 MiB of per-process CPU buffers that do not depend on the method swamped the comparison (0.65)
    boc = [32, 64, 128] if quick else [128, 256, 512]  # quick: a smoke run, the memory ratio means nothing there
    kw = dict(block_out_channels=boc, sample_size=16, pairs=2, steps=1 if quick else 3, gradient_checkpointing=True)
    repeats = 1 if quick else 2
    res = {"ours": [], "copy": []}
    for _ in range(repeats):
        for impl in ("ours", "copy"):
            res[impl].append(common.run_child("p5_diffusion_dpo_memory", "dpo_child", dict(impl=impl, **kw)))
    errs = [r["error"] for v in res.values() for r in v if "error" in r]
    if errs:
        return [common.error_row("P5", "Diffusion-DPO peak memory", "; ".join(errs))]
    ours = min(r["peak_bytes"] for r in res["ours"])  # min over fresh processes: least background heap noise
    base = min(r["peak_bytes"] for r in res["copy"])
    o, b = res["ours"][0], res["copy"][0]
    notes = (f"UNet {tuple(boc)} x2 layers, {o['unet_bytes'] / 2**20:.0f} MiB fp32 weights, LoRA r8 "
             f"({o['lora_params'] / 1e3:.0f}k params), 16x16 latents, 2 pairs, {kw['steps']} DPO steps, gradient "
             "checkpointing on both (DiffusionDPO's SDXL setting); peak RSS minus "
             f"RSS before building the UNet, min of {repeats} fresh processes each; CPU")
    l0o, l0b = o["losses"][0], b["losses"][0]
    return [common.row("P5", "Diffusion-DPO peak memory (adapter-off ref vs frozen copy)", ours, base, "bytes", "lower", 0.6,
                       notes, raw=res),
            common.row("P5-loss0", "Diffusion-DPO loss at init (ln 2 expected)", l0o, l0b, "nats", "lower", None,
                       f"|ours - copy| = {abs(l0o - l0b):.3g}; |ours - ln2| = {abs(l0o - math.log(2)):.3g}",
                       abs_diff=abs(l0o - l0b))]


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=1, default=str))
