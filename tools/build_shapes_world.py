"""How the shapes world's assets in ``unialign/embedded/assets/image`` are built: the training recipe for the tiny
CLIP, the LAION-shaped aesthetic head, the VAE, the SDXL-architecture UNet and the SD3-architecture transformer,
the statistics and the writer of ``BUILD.md``, and the check that a rebuild gives the shipped files. The data, the
gold score and the models are described in ``unialign.embedded.shapes_world`` (what a run needs); this module is
only needed to rebuild or re-measure the assets.

CLI (from the repository root)::

    python -m tools.build_shapes_world build --out DIR        # deterministic rebuild (the shipped: unialign/embedded/assets/image)
    python -m tools.build_shapes_world build-head --out DIR   # only the (last) head stage
    python -m tools.build_shapes_world build-sd3 --out DIR    # the SD3 model (after build)
    python -m tools.build_shapes_world eval [--path DIR] [--n 64]   # reward / gold statistics
    python -m tools.build_shapes_world markdown --out DIR     # rewrite DIR/BUILD.md from DIR/build_report.json
    python -m tools.build_shapes_world check --stage STAGE    # rebuild a stage in a temp folder, compare (sha256)

``check`` stages, each with the shipped record's arguments (``build_report.json``) and what it compares; the
seconds are one thread of a shared 2-core machine, measured: ``data`` (tokenizer, prompt split: 1 s), ``clip``
(data + CLIP: 20 s), ``head`` (the aesthetic head on the shipped CLIP and SDXL model: 60 s), ``sdxl`` (data + VAE +
UNet and both text encoders: 310 s), ``sd3`` (the SD3 model on the shipped tokenizer and VAE: 265 s), ``all``
(every stage in order, then the statistics and the records: 675 s; ``build_report.json`` without its wall-clock fields
and ``BUILD.md`` with its seconds masked). Each stage seeds itself, so a stage alone writes what the whole build
writes. Exit status 0 when every file is bit-identical.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tools.asset_check import (
    Comparison,
    add_check,
    builder_cli,
    compare,
    files_under,
    json_without,
    report_check,
)
from unialign.embedded.shapes_world import (
    BOS_TOKEN,
    CLIP_MEAN,
    CLIP_STD,
    CONTEXT_LENGTH,
    DEFAULT_ASSET_DIR,
    DEGRADATIONS,
    EOS_TOKEN,
    IMAGE_SIZE,
    SAMPLING_DEFAULTS,
    SD3_MAX_SEQUENCE_LENGTH,
    ShapeSample,
    Tensor,
    build_clip,
    caption,
    caption_words,
    clip_config,
    degrade,
    gold_score,
    load_embedded,
    load_embedded_clip,
    load_tokenizer,
    prompts,
    shape_dataset,
    to_tensor,
    tokenize,
    write_tokenizer,
)


def _log(msg: str) -> None:
    print(msg, flush=True)


def _augment(x: Tensor, rng: random.Random, generator: torch.Generator, p_degrade: float = 0.5):
    """Degrade each image with probability ``p_degrade`` (one random kind, strength in [0.5, 1]).
    Returns the images and each one's degradation word (or None)."""
    kinds: list[str | None] = [rng.choice(DEGRADATIONS) if rng.random() < p_degrade else None for _ in range(len(x))]
    out = x.clone()
    for kind in DEGRADATIONS:
        rows = [i for i, k in enumerate(kinds) if k == kind]
        if rows:
            strength = torch.tensor([rng.uniform(0.5, 1.0) for _ in rows])
            out[rows] = degrade(x[rows], kind, strength, generator)
    return out, kinds


def _normalise(x: Tensor, mean=CLIP_MEAN, std=CLIP_STD) -> Tensor:
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def train_clip(data: list[ShapeSample], x_N: Tensor, tokenizer, steps: int, batch_size: int, seed: int):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    model = build_clip(clip_config(len(tokenizer.get_vocab())))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        idx = rng.sample(range(len(data)), batch_size)
        images, kinds = _augment(x_N[idx], rng, gen)
        texts = [caption(data[i].shape, data[i].colour, data[i].background,
                         data[i].size if rng.random() < 0.5 else None, kinds[j]) for j, i in enumerate(idx)]
        img = F.normalize(model.encode_image(_normalise(images)), dim=-1)
        txt = F.normalize(model.encode_text(tokenize(tokenizer, texts)), dim=-1)
        logits = model.logit_scale.exp() * img @ txt.T
        # captions can repeat inside a batch: every identical caption is a positive
        same = torch.tensor([[a == b for b in texts] for a in texts], dtype=torch.float32)
        targets = same / same.sum(1, keepdim=True)
        loss = 0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if step % 50 == 0 or step == steps - 1:
            _log(f"  clip step {step:4d} loss {loss.item():.3f}")
    return model.eval().requires_grad_(False)


@torch.no_grad()
def clip_image_embeddings(model, x: Tensor, batch_size: int = 256) -> Tensor:
    """L2-normalised image embeddings of images in [0, 1] already at the model's size. [B, D]"""
    out = [F.normalize(model.encode_image(_normalise(x[i:i + batch_size])), dim=-1) for i in range(0, len(x), batch_size)]
    return torch.cat(out)


@torch.no_grad()
def policy_space_images(policy, x_N: Tensor, seed: int, noise_per_scale: int = 1200, samples_per_scale: int = 300,
                        noise_scales=(0.3, 0.6, 1.0), guidance_scales=(0.0, 1.0, 3.0, 6.0)) -> Tensor:
    """Images of the space the RL policy actually reaches: VAE decodes (every image a ``DiffusionPolicy``
    samples is ``vae.decode(z)``). The VAE reconstructions of ``x_N``, decodes of their latents plus
    Gaussian noise (``noise_scales``, in scaled-latent units), decodes of pure N(0, 1) latents, and samples
    of ``policy`` on training prompts at several CFG weights (0 = unconditional; large ones oversaturate).
    Deterministic for a fixed ``seed``. Float [M, 3, H, W] in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    vae, sf = policy.vae, policy.vae.config.scaling_factor

    def decode(z: Tensor) -> Tensor:
        return torch.cat([((vae.decode(z[i:i + 256] / sf).sample + 1) / 2).clamp(0, 1) for i in range(0, len(z), 256)])

    latents = torch.cat([vae.encode(x_N[i:i + 256] * 2 - 1).latent_dist.mean for i in range(0, len(x_N), 256)]) * sf
    out = [decode(latents)]
    for scale in noise_scales:
        idx = torch.randperm(len(latents), generator=gen)[:noise_per_scale]
        out.append(decode(latents[idx] + scale * torch.randn(latents[idx].shape, generator=gen)))
    out.append(decode(torch.randn((noise_per_scale, *latents.shape[1:]), generator=gen)))
    plist, guidance = prompts("train"), policy.guidance_scale
    try:
        for w in guidance_scales:
            policy.guidance_scale = w
            batch = [plist[i % len(plist)] for i in range(samples_per_scale)]
            out.append(to_tensor(policy.sample(batch, generator=gen).completions))
    finally:
        policy.guidance_scale = guidance
    return torch.cat(out)


def train_head(model, x_N: Tensor, steps: int, seed: int, copies: int = 3, extra: Tensor | None = None):
    """MSE regression of ``gold_score`` on the L2-normalised CLIP image embedding, on ``x_N``, ``copies``
    degraded copies of it and ``extra`` images (``policy_space_images``). Returns the head and Pearson
    r(prediction, gold) on its training images (and on ``extra`` alone, None without it)."""
    from unialign.rewards.image import AestheticMLP

    torch.manual_seed(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    xs = [x_N] + [_augment(x_N, rng, gen, p_degrade=0.8)[0] for _ in range(copies)]
    if extra is not None:
        xs.append(extra)
    images = torch.cat(xs)
    emb, gold = clip_image_embeddings(model, images), gold_score(images)
    head = AestheticMLP(emb.shape[1])
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    head.train()
    for step in range(steps):
        idx = torch.randint(0, len(emb), (512,), generator=gen)
        loss = F.mse_loss(head(emb[idx]).squeeze(-1), gold[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            _log(f"  head step {step:4d} mse {loss.item():.5f}")
    head.eval().requires_grad_(False)
    with torch.no_grad():
        pred = head(emb).squeeze(-1)
    corr = float(torch.corrcoef(torch.stack([pred, gold]))[0, 1])
    n = 0 if extra is None else len(extra)
    extra_corr = float(torch.corrcoef(torch.stack([pred[-n:], gold[-n:]]))[0, 1]) if n else None
    return head, corr, extra_corr


def _text_config(vocab_size: int, hidden: int, projection: int, eos_id: int, bos_id: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=2,
                          num_hidden_layers=2, max_position_embeddings=CONTEXT_LENGTH, projection_dim=projection,
                          bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id, hidden_act="quick_gelu")


def build_diffusion_components(tokenizer, seed: int) -> dict[str, Any]:
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    vocab = tokenizer.get_vocab()
    ids = dict(vocab_size=len(vocab), eos_id=vocab[EOS_TOKEN], bos_id=vocab[BOS_TOKEN])
    text_encoder = CLIPTextModel(_text_config(hidden=32, projection=32, **ids))
    text_encoder_2 = CLIPTextModelWithProjection(_text_config(hidden=32, projection=32, **ids))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32), latent_channels=4,
                        norm_num_groups=8, layers_per_block=1, sample_size=IMAGE_SIZE, mid_block_add_attention=False)
    unet = UNet2DConditionModel(
        sample_size=IMAGE_SIZE // 4, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), norm_num_groups=8, use_linear_projection=True, transformer_layers_per_block=(1, 1),
        addition_embed_type="text_time", addition_time_embed_dim=8,
        cross_attention_dim=32 + 32,  # hidden sizes of text_encoder + text_encoder_2
        projection_class_embeddings_input_dim=6 * 8 + 32,  # 6 time ids x 8 + pooled (projection_dim 32)
    )
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return dict(unet=unet, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, scheduler=scheduler)


def train_vae(vae, x_N: Tensor, steps: int, batch_size: int, seed: int, kl_weight: float = 1e-6) -> float:
    """Train the VAE as an autoencoder (L1 + MSE reconstruction of [-1, 1] pixels, tiny KL); set its
    ``scaling_factor`` to 1 / std of the latents (as SD). Returns the final reconstruction MSE."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    vae.train()
    pixels = x_N * 2 - 1
    for step in range(steps):
        batch = pixels[torch.randint(0, len(pixels), (batch_size,), generator=gen)]
        dist = vae.encode(batch).latent_dist
        recon = vae.decode(dist.sample(gen)).sample
        mse = F.mse_loss(recon, batch)
        loss = mse + F.l1_loss(recon, batch) + kl_weight * dist.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            _log(f"  vae step {step:4d} mse {mse.item():.4f}")
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        latents = torch.cat([vae.encode(pixels[i:i + 256]).latent_dist.mean for i in range(0, len(pixels), 256)])
        recon = torch.cat([vae.decode(latents[i:i + 256]).sample for i in range(0, len(latents), 256)])
    vae.register_to_config(scaling_factor=float(1.0 / latents.std()))
    return float(F.mse_loss(recon, pixels))


def _encode_text(text_encoder, text_encoder_2, ids: Tensor) -> tuple[Tensor, Tensor]:
    """SDXL conditioning as the stock pipeline / DiffusionPolicy: penultimate hidden states of both
    encoders concatenated, and the 2nd encoder's projected pooled output."""
    out1 = text_encoder(ids, output_hidden_states=True)
    out2 = text_encoder_2(ids, output_hidden_states=True)
    return torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1), out2.text_embeds


def train_unet(parts: dict[str, Any], latents_N: Tensor, prompt_ids_N: Tensor, steps: int, batch_size: int,
               seed: int, p_uncond: float = 0.1) -> None:
    """Epsilon-prediction training of the UNet and both text encoders; conditioning dropped (set to
    zeros, SDXL's ``force_zeros_for_empty_prompt``) with probability ``p_uncond``."""
    unet, te1, te2, scheduler = parts["unet"], parts["text_encoder"], parts["text_encoder_2"], parts["scheduler"]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    params = [*unet.parameters(), *te1.parameters(), *te2.parameters()]
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.05)
    time_ids = torch.tensor([[IMAGE_SIZE, IMAGE_SIZE, 0, 0, IMAGE_SIZE, IMAGE_SIZE]], dtype=torch.float32)
    for m in (unet, te1, te2):
        m.train()
    ema = None
    for step in range(steps):
        idx = torch.randint(0, len(latents_N), (batch_size,), generator=gen)
        x0 = latents_N[idx]
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch_size,), generator=gen)
        x_t = scheduler.add_noise(x0, noise, t)
        embeds, pooled = _encode_text(te1, te2, prompt_ids_N[idx])
        keep = (torch.rand(batch_size, generator=gen) >= p_uncond).float()
        embeds, pooled = embeds * keep.view(-1, 1, 1), pooled * keep.view(-1, 1)
        pred = unet(x_t, t, encoder_hidden_states=embeds,
                    added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids.expand(batch_size, -1)}).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            _log(f"  unet step {step:4d} loss(ema) {ema:.4f}")
    for m in (unet, te1, te2):
        m.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# The SD3-architecture (flow-matching) model
# ---------------------------------------------------------------------------------------------
SD3_LAYERS = 2  # joint transformer blocks of the embedded SD3 transformer


def build_sd3_components(tokenizer, seed: int, shift: float = 1.0) -> dict[str, Any]:
    """Untrained tiny SD3 parts: two ``CLIPTextModelWithProjection`` (hidden 32, projection 32: the
    penultimate states concatenate to 64 = ``joint_attention_dim``, the pooled ones to 64 =
    ``pooled_projection_dim``), an ``SD3Transformer2DModel`` on 4x8x8 latents (patch 2: 16 image tokens,
    width 64, 2 joint blocks) and a ``FlowMatchEulerDiscreteScheduler`` (``shift``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    vocab = tokenizer.get_vocab()
    ids = dict(vocab_size=len(vocab), eos_id=vocab[EOS_TOKEN], bos_id=vocab[BOS_TOKEN])
    text_encoder = CLIPTextModelWithProjection(_text_config(hidden=32, projection=32, **ids))
    text_encoder_2 = CLIPTextModelWithProjection(_text_config(hidden=32, projection=32, **ids))
    transformer = SD3Transformer2DModel(sample_size=IMAGE_SIZE // 4, patch_size=2, in_channels=4, out_channels=4,
                                        num_layers=SD3_LAYERS, attention_head_dim=16, num_attention_heads=4,
                                        joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=64,
                                        pos_embed_max_size=IMAGE_SIZE // 4 // 2)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    return dict(transformer=transformer, text_encoder=text_encoder, text_encoder_2=text_encoder_2, scheduler=scheduler)


def sd3_vae(sdxl_dir: str | Path):
    """The embedded SDXL model's VAE (same weights and ``scaling_factor``) with ``shift_factor`` 0.0, which
    ``StableDiffusion3Pipeline`` adds after unscaling (None would fail there): it decodes the same images."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(str(Path(sdxl_dir) / "vae"))
    vae.register_to_config(shift_factor=0.0)
    return vae.eval().requires_grad_(False)


def encode_sd3_prompt(text_encoder, text_encoder_2, ids: Tensor, joint_attention_dim: int,
                      max_sequence_length: int) -> tuple[Tensor, Tensor]:
    """``StableDiffusion3Pipeline.encode_prompt`` without T5 (as ``FlowMatchingPolicy.encode_prompts``), differentiable:
    penultimate hidden states of both encoders concatenated on features, zero-padded to ``joint_attention_dim``,
    followed by ``max_sequence_length`` zero tokens (the absent T5): [B, L + max_sequence_length, D]; pooled =
    both projected pooled outputs concatenated [B, P1 + P2]."""
    out1 = text_encoder(ids, output_hidden_states=True)
    out2 = text_encoder_2(ids, output_hidden_states=True)
    clip = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
    clip = F.pad(clip, (0, joint_attention_dim - clip.shape[-1]))
    t5 = clip.new_zeros(len(ids), max_sequence_length, joint_attention_dim)
    return torch.cat([clip, t5], dim=1), torch.cat([out1.text_embeds, out2.text_embeds], dim=-1)


def train_sd3(parts: dict[str, Any], latents_N: Tensor, prompt_ids_N: Tensor, empty_ids: Tensor, steps: int,
              batch_size: int, seed: int, max_sequence_length: int, p_uncond: float = 0.1, lr: float = 1e-3) -> float:
    """Rectified-flow training (SD3, Esser et al. 2024, arXiv 2403.03206) of the transformer and both text
    encoders: x_s = (1 - s) x0 + s eps with s ~ logit-normal(0, 1) (SD3's default density), target the velocity
    eps - x0, timestep s x 1000 (``FlowMatchEulerDiscreteScheduler``'s timesteps are sigma x 1000). The prompt is
    replaced by the empty prompt ``empty_ids`` [1, L] with probability ``p_uncond`` (CFG's unconditional branch in
    the stock pipeline). Returns the final loss (EMA 0.95)."""
    transformer, te1, te2 = parts["transformer"], parts["text_encoder"], parts["text_encoder_2"]
    dim = transformer.config.joint_attention_dim
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    params = [*transformer.parameters(), *te1.parameters(), *te2.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    for m in (transformer, te1, te2):
        m.train()
    ema = float("nan")
    for step in range(steps):
        idx = torch.randint(0, len(latents_N), (batch_size,), generator=gen)
        x0 = latents_N[idx]
        noise = torch.randn(x0.shape, generator=gen)
        s = torch.sigmoid(torch.randn(batch_size, generator=gen))
        x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * noise
        keep = torch.rand(batch_size, generator=gen) >= p_uncond
        ids = torch.where(keep.view(-1, 1), prompt_ids_N[idx], empty_ids)
        embeds, pooled = encode_sd3_prompt(te1, te2, ids, dim, max_sequence_length)
        pred = transformer(hidden_states=x_s, timestep=s * 1000, encoder_hidden_states=embeds,
                           pooled_projections=pooled, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if step == 0 else 0.95 * ema + 0.05 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            _log(f"  sd3 step {step:4d} loss(ema) {ema:.4f}")
    for m in (transformer, te1, te2):
        m.eval().requires_grad_(False)
    return ema


@torch.no_grad()
def sd3_prompt_fidelity(path: str | Path | None = None, n: int = 168, seed: int = 0, steps: tuple[int, ...] = (8, 10),
                        guidance_scales: tuple[float, ...] = (1.0, 3.0), **policy_kwargs: Any) -> dict[str, float]:
    """The shape verifier's all-three-right rate of ``n`` samples (prompts cycled) per split, CFG weight and step
    count, drawn by ``load_embedded_sd3`` (Flow-GRPO's SDE sampler, noise level 0.7, unless ``policy_kwargs`` say
    otherwise). Keys ``"{split}_cfg{w}_steps{N}"``."""
    from unialign.embedded.shape_verifier import verify
    from unialign.embedded.shapes_world import load_embedded_sd3

    out: dict[str, float] = {}
    for num_steps in steps:
        for guidance in guidance_scales:
            policy = load_embedded_sd3(path, num_steps=num_steps, guidance_scale=guidance, **policy_kwargs)
            for split in ("train", "test"):
                plist = prompts(split)
                batch = [plist[i % len(plist)] for i in range(n)]
                images = policy.sample(batch, generator=torch.Generator().manual_seed(seed)).completions
                out[f"{split}_cfg{guidance:g}_steps{num_steps}"] = float(verify(batch, images)["all"].mean())
    return out


def build_sd3_model(out_dir: str | Path, seed: int = 0, steps: int = 5000, batch_size: int = 64, per_prompt: int = 16,
                    threads: int = 1, shift: float = 1.0, lr: float = 1e-3) -> dict[str, Any]:
    """Train and save ``out_dir/sd3`` (a diffusers ``StableDiffusion3Pipeline`` folder) deterministically from the
    VAE and tokenizer already in ``out_dir`` (run after ``build``: it reuses that VAE). Returns what the report
    needs of it: the parts, the final loss, the number of training images and the training seconds."""
    from diffusers import StableDiffusion3Pipeline

    torch.set_num_threads(threads)
    out = Path(out_dir)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(out / "tokenizer")
    vae = sd3_vae(out / "sdxl")
    data = shape_dataset("train", per_prompt=per_prompt, seed=seed)
    with torch.no_grad():
        pixels = to_tensor([d.image for d in data]) * 2 - 1
        latents = torch.cat([vae.encode(pixels[i:i + 256]).latent_dist.mean for i in range(0, len(pixels), 256)])
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
    parts = build_sd3_components(tokenizer, seed, shift=shift)
    final_loss = train_sd3(parts, latents, tokenize(tokenizer, [d.prompt for d in data]), tokenize(tokenizer, [""]),
                           steps, batch_size, seed, max_sequence_length=SD3_MAX_SEQUENCE_LENGTH, lr=lr)
    train_s = time.perf_counter() - t0
    pipe = StableDiffusion3Pipeline(transformer=parts["transformer"], scheduler=parts["scheduler"], vae=vae,
                                    text_encoder=parts["text_encoder"], tokenizer=tokenizer,
                                    text_encoder_2=parts["text_encoder_2"], tokenizer_2=tokenizer,
                                    text_encoder_3=None, tokenizer_3=None)
    pipe.save_pretrained(str(out / "sd3"))
    _log(f"sd3: trained {steps} steps in {train_s:.1f}s, final loss {final_loss:.4f}")
    return dict(parts=parts, final_loss=final_loss, train_images=len(data), train_seconds=train_s)


def build_sd3(out_dir: str | Path, seed: int = 0, steps: int = 5000, batch_size: int = 64, per_prompt: int = 16,
              threads: int = 1, shift: float = 1.0, lr: float = 1e-3) -> dict[str, Any]:
    """Build ``out_dir/sd3`` (``build_sd3_model``), measure its prompt fidelity, and add an ``"sd3"`` section to
    ``build_report.json`` / ``BUILD.md``."""
    out = Path(out_dir)
    model = build_sd3_model(out, seed=seed, steps=steps, batch_size=batch_size, per_prompt=per_prompt, threads=threads,
                            shift=shift, lr=lr)
    parts, final_loss, train_s = model["parts"], model["final_loss"], model["train_seconds"]
    t0 = time.perf_counter()
    fidelity = sd3_prompt_fidelity(out, seed=seed)
    eval_s = time.perf_counter() - t0
    report_path = out / "build_report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    report.setdefault("sizes_bytes", {})["sd3"] = _dir_size(out / "sd3")
    report["sd3"] = {"seed": seed, "threads": threads, "steps": steps, "batch_size": batch_size, "lr": lr,
                     "per_prompt": per_prompt, "train_images": model["train_images"], "shift": shift,
                     "layers": SD3_LAYERS, "max_sequence_length": SD3_MAX_SEQUENCE_LENGTH, "final_loss": final_loss,
                     "transformer_params": sum(p.numel() for p in parts["transformer"].parameters()),
                     "timings_s": {"build": train_s, "eval": eval_s}, "size_bytes": report["sizes_bytes"]["sd3"],
                     "fidelity": fidelity}
    report_path.write_text(json.dumps(report, indent=1))
    if "timings_s" in report:
        (out / "BUILD.md").write_text(build_markdown(report))
    _log(json.dumps(report["sd3"], indent=1))
    return report["sd3"]


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build_head(out: Path, x_N: Tensor, clip, steps: int, seed: int) -> tuple[float, float | None, int]:
    """Train and save the aesthetic head of ``out`` from its CLIP and diffusion model (which must be
    saved there already). Returns r(pred, gold) on all its training images, on the policy-space ones,
    and how many of those there are."""
    policy = load_embedded(out, num_steps=8)
    extra = policy_space_images(policy, x_N, seed)
    head, corr, extra_corr = train_head(clip, x_N, steps, seed=seed, extra=extra)
    torch.save({k: v.contiguous() for k, v in head.state_dict().items()}, out / "aesthetic_head.pth")
    _log(f"head: train corr(pred, gold) {corr:.3f}, on {len(extra)} policy-space images {extra_corr:.3f}")
    return corr, extra_corr, len(extra)


def rebuild_head(out_dir: str | Path, seed: int = 0, head_steps: int = 1500, per_prompt: int = 16, threads: int = 1,
                 n_eval: int = 64) -> dict[str, Any]:
    """Re-run only the head stage of ``build`` on the CLIP and diffusion model already in ``out_dir``
    (same result as the head stage of a full build with the same arguments); rewrites the report."""
    torch.set_num_threads(threads)
    out = Path(out_dir)
    report = json.loads((out / "build_report.json").read_text())
    x_N = to_tensor([d.image for d in shape_dataset("train", per_prompt=per_prompt, seed=seed)])
    t0 = time.perf_counter()
    corr, extra_corr, n_extra = build_head(out, x_N, load_embedded_clip(out).model, head_steps, seed)
    t = report["timings_s"]
    t["total_build"] += time.perf_counter() - t0 - t["head"]
    t["head"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    report["eval"] = evaluate(out, n=n_eval, seed=seed)
    t["eval"] = time.perf_counter() - t0
    report["steps"]["head"] = head_steps
    report.update(head_train_corr=corr, head_policy_space_corr=extra_corr, head_policy_space_images=n_extra)
    report["sizes_bytes"] = {p.name: _dir_size(p) if p.is_dir() else p.stat().st_size for p in sorted(out.iterdir())
                             if p.name not in ("build_report.json", "BUILD.md")}
    (out / "build_report.json").write_text(json.dumps(report, indent=1))
    (out / "BUILD.md").write_text(build_markdown(report))
    _log(json.dumps(report, indent=1))
    return report


def build_data_stage(out: Path, seed: int, per_prompt: int) -> tuple[list[ShapeSample], Tensor, Any]:
    """The data stage: the training images (``shape_dataset``, in memory), ``out/tokenizer`` and
    ``out/prompts.json``. Returns (data, their images [N, 3, H, W] in [0, 1], the tokenizer)."""
    data = shape_dataset("train", per_prompt=per_prompt, seed=seed)
    x_N = to_tensor([d.image for d in data])
    tokenizer = load_tokenizer(write_tokenizer(out / "tokenizer"))
    for word in caption_words():  # every caption word must be a single token
        assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    (out / "prompts.json").write_text(json.dumps({"train": prompts("train"), "test": prompts("test")}, indent=1))
    return data, x_N, tokenizer


def build_clip_stage(out: Path, data: list[ShapeSample], x_N: Tensor, tokenizer, steps: int, seed: int):
    """The CLIP stage: train it (``train_clip``, batch 128) and save ``out/clip``. Returns the model."""
    from safetensors.torch import save_file

    clip = train_clip(data, x_N, tokenizer, steps, batch_size=128, seed=seed)
    (out / "clip").mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in clip.state_dict().items()}, str(out / "clip" / "open_clip_model.safetensors"))
    cfg = {"model_cfg": clip_config(len(tokenizer.get_vocab())),
           "preprocess_cfg": {"size": IMAGE_SIZE, "mean": list(CLIP_MEAN), "std": list(CLIP_STD),
                              "interpolation": "bicubic", "resize_mode": "shortest"},
           "tokenizer": "../tokenizer (transformers.CLIPTokenizer)"}
    (out / "clip" / "open_clip_config.json").write_text(json.dumps(cfg, indent=1))
    return clip


def build_sdxl_stage(out: Path, data: list[ShapeSample], x_N: Tensor, tokenizer, vae_steps: int, unet_steps: int,
               seed: int) -> dict[str, float]:
    """The SDXL stage: the VAE (``train_vae``, batch 32), then the UNet and both text encoders on its latents
    (``train_unet``, batch 64), saved as ``out/sdxl`` (a ``StableDiffusionXLPipeline`` folder). Returns the VAE's
    reconstruction MSE and the two parts' seconds."""
    from diffusers import StableDiffusionXLPipeline

    t0 = time.perf_counter()
    parts = build_diffusion_components(tokenizer, seed)
    vae_mse = train_vae(parts["vae"], x_N, vae_steps, batch_size=32, seed=seed)
    vae_s = time.perf_counter() - t0
    _log(f"vae: recon mse {vae_mse:.4f} ([-1,1] pixels), scaling_factor {parts['vae'].config.scaling_factor:.3f} "
         f"({vae_s:.1f}s)")
    t0 = time.perf_counter()
    with torch.no_grad():
        pixels = x_N * 2 - 1
        latents = torch.cat([parts["vae"].encode(pixels[i:i + 256]).latent_dist.mean for i in range(0, len(pixels), 256)])
        latents = latents * parts["vae"].config.scaling_factor
    prompt_ids = tokenize(tokenizer, [d.prompt for d in data])
    train_unet(parts, latents, prompt_ids, unet_steps, batch_size=64, seed=seed)
    unet_s = time.perf_counter() - t0
    pipe = StableDiffusionXLPipeline(vae=parts["vae"], text_encoder=parts["text_encoder"],
                                     text_encoder_2=parts["text_encoder_2"], tokenizer=tokenizer, tokenizer_2=tokenizer,
                                     unet=parts["unet"], scheduler=parts["scheduler"],
                                     force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe.save_pretrained(str(out / "sdxl"))
    return {"vae_recon_mse": vae_mse, "vae": vae_s, "unet": unet_s}


def build(out_dir: str | Path, seed: int = 0, clip_steps: int = 150, head_steps: int = 1500, vae_steps: int = 1000,
          unet_steps: int = 1000, per_prompt: int = 16, threads: int = 1, n_eval: int = 64) -> dict[str, Any]:
    """Build every asset but ``sd3/`` into ``out_dir`` deterministically (same machine, torch and ``threads``):
    the data, CLIP, SDXL and head stages in that order (each seeds itself), then the statistics,
    ``build_report.json`` and ``BUILD.md``."""
    torch.set_num_threads(threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t_all = t0 = time.perf_counter()

    data, x_N, tokenizer = build_data_stage(out, seed, per_prompt)
    timings["data"] = time.perf_counter() - t0
    _log(f"data: {len(data)} images, {len(prompts('train'))} train / {len(prompts('test'))} test prompts, "
         f"vocab {len(tokenizer.get_vocab())} ({timings['data']:.1f}s)")

    t0 = time.perf_counter()
    clip = build_clip_stage(out, data, x_N, tokenizer, clip_steps, seed)
    timings["clip"] = time.perf_counter() - t0

    sdxl = build_sdxl_stage(out, data, x_N, tokenizer, vae_steps, unet_steps, seed)
    timings["vae"], timings["unet"], vae_mse = sdxl["vae"], sdxl["unet"], sdxl["vae_recon_mse"]

    # the head last: it is trained on what the saved diffusion model can produce (``policy_space_images``)
    t0 = time.perf_counter()
    head_corr, head_extra_corr, n_extra = build_head(out, x_N, clip, head_steps, seed)
    timings["head"] = time.perf_counter() - t0
    timings["total_build"] = time.perf_counter() - t_all

    t0 = time.perf_counter()
    stats = evaluate(out, n=n_eval, seed=seed)
    timings["eval"] = time.perf_counter() - t0
    sizes = {p.name: _dir_size(p) if p.is_dir() else p.stat().st_size for p in sorted(out.iterdir())}
    report = {"seed": seed, "threads": threads, "steps": dict(clip=clip_steps, head=head_steps, vae=vae_steps,
              unet=unet_steps), "per_prompt": per_prompt, "train_images": len(data), "head_train_corr": head_corr,
              "head_policy_space_corr": head_extra_corr, "head_policy_space_images": n_extra,
              "vae_recon_mse": vae_mse, "timings_s": timings, "sizes_bytes": sizes, "eval": stats}
    (out / "build_report.json").write_text(json.dumps(report, indent=1))
    (out / "BUILD.md").write_text(build_markdown(report))
    _log(json.dumps(report, indent=1))
    return report


def build_markdown(report: dict[str, Any]) -> str:
    """``BUILD.md`` for the asset folder, from ``build``'s report."""
    t, e, sizes = report["timings_s"], report["eval"], report["sizes_bytes"]
    steps = report["steps"]
    lines = [
        "# Embedded image default: build record",
        "",
        "Built by `tools.build_shapes_world` (read `unialign.embedded.shapes_world`'s module docstring for the data, "
        "gold score and models):",
        "",
        "```",
        f"python -m tools.build_shapes_world build --out unialign/embedded/assets/image --seed {report['seed']} "
        f"--clip-steps {steps['clip']} --head-steps {steps['head']} --vae-steps {steps['vae']} "
        f"--unet-steps {steps['unet']} --per-prompt {report['per_prompt']} --threads {report['threads']}",
        "python -m tools.build_shapes_world eval     # re-measures the sample statistics below",
        "```",
        "",
        f"Deterministic for a fixed seed, torch version and thread count ({report['threads']}; with more threads",
        "than free cores, OpenMP oversubscription makes these tiny models 10-30x slower).",
        "",
        "## Contents and sizes",
        "",
        "| path | bytes | what |",
        "|---|---:|---|",
    ]
    what = {"sdxl": "diffusers `StableDiffusionXLPipeline` folder (UNet, VAE, 2 text encoders, tokenizers, DDIM)",
            "clip": "open_clip `CLIP` state dict + config (tiny ViT / text transformer, embed dim 64)",
            "aesthetic_head.pth": "`AestheticMLP(64)` state dict (LAION key names)",
            "tokenizer": "CLIP BPE `vocab.json` / `merges.txt` written in code",
            "sd3": "diffusers `StableDiffusion3Pipeline` folder (SD3 transformer, the `sdxl` VAE, 2 CLIP encoders, no T5)",
            "prompts.json": "train / held-out prompt split",
            "build_report.json": "the numbers of this page, machine readable"}
    for name, size in sizes.items():
        lines.append(f"| `{name}` | {size:,} | {what.get(name, '')} |")
    lines += [
        f"| total | {sum(sizes.values()):,} | |",
        "",
        "## Build (wall seconds, one CPU thread, shared 2-core machine)",
        "",
        "| stage | steps | seconds |",
        "|---|---:|---:|",
        f"| data ({report['train_images']} images, {report['per_prompt']} per training prompt) | | {t['data']:.1f} |",
        f"| CLIP (contrastive, batch 128) | {steps['clip']} | {t['clip']:.1f} |",
        f"| aesthetic head (MSE on gold, batch 512; after the UNet: needs its samples) | {steps['head']} | {t['head']:.1f} |",
        f"| VAE (L1 + MSE + 1e-6 KL, batch 32) | {steps['vae']} | {t['vae']:.1f} |",
        f"| UNet + text encoders (eps-prediction, batch 64) | {steps['unet']} | {t['unet']:.1f} |",
        f"| **total build** | | **{t['total_build']:.1f}** |",
        f"| evaluation below (sampling + rewards) | | {t['eval']:.1f} |",
        "",
        f"Aesthetic head: Pearson r(prediction, gold) = {report['head_train_corr']:.3f} on its training images "
        f"(clean + degraded + {report.get('head_policy_space_images', 0)} policy-space images: VAE decodes of data / "
        f"noised / random latents and model samples at CFG 0-6), {report.get('head_policy_space_corr') or float('nan'):.3f} "
        f"on the policy-space ones alone. VAE reconstruction MSE on [-1, 1] pixels: {report['vae_recon_mse']:.4f}.",
        "",
        f"## Samples ({e['n']} images, training prompts, {SAMPLING_DEFAULTS['num_steps']} DDIM steps, eta "
        f"{SAMPLING_DEFAULTS['eta']}, CFG {SAMPLING_DEFAULTS['guidance_scale']}, seed {report['seed']})",
        "",
        "| quantity | mean | std |",
        "|---|---:|---:|",
        f"| embedded aesthetic reward | {e['aesthetic_mean']:.4f} | {e['aesthetic_std']:.4f} |",
        f"| gold_score | {e['gold_mean']:.4f} | {e['gold_std']:.4f} |",
        f"| embedded CLIP score (2.5 max(cos, 0)) | {e['clip_score_mean']:.4f} | {e['clip_score_std']:.4f} |",
        f"| gold_score of the training images (reference) | {e['dataset_gold_mean']:.4f} | {e['dataset_gold_std']:.4f} |",
        "",
        f"Pearson correlation of aesthetic reward with gold_score on the samples: **{e['corr_aesthetic_gold']:.3f}**.",
        f"Within a prompt ({e['within_prompt_groups']} prompts x samples, each centred on its prompt's mean, as per-prompt",
        f"advantages see it): **{e['corr_aesthetic_gold_within_prompt']:.3f}** (mean within-prompt std: reward "
        f"{e['aesthetic_within_prompt_std']:.4f}, gold {e['gold_within_prompt_std']:.4f}).",
        f"Sampling the {e['n']} images took {e['sample_seconds']:.1f} s.",
        "",
    ]
    if "fidelity" in e:
        f = e["fidelity"]
        lines += [
            "## Prompt fidelity (shape verifier, all three of background / colour / shape right)",
            "",
            "168 samples per row (prompts cycled), 8 DDIM steps, eta 1, seed "
            f"{report['seed']}; VAE round trip of one clean render per prompt: **{f['vae_round_trip']:.3f}**.",
            "",
            "| prompts | CFG 1 | CFG 3 |",
            "|---|---:|---:|",
            f"| training | {f['train_cfg1']:.3f} | {f['train_cfg3']:.3f} |",
            f"| held-out | {f['test_cfg1']:.3f} | {f['test_cfg3']:.3f} |",
            "",
        ]
    if "sd3" in report:
        lines += sd3_markdown(report["sd3"], report["sizes_bytes"])
    return "\n".join(lines)


def sd3_markdown(r: dict[str, Any], sizes: dict[str, int]) -> list[str]:
    """The "Embedded SD3 (flow matching)" section of ``BUILD.md`` (lines), from ``build_sd3``'s report."""
    f = r["fidelity"]
    steps = sorted({int(k.rsplit("steps", 1)[1]) for k in f})
    lines = [
        "## Embedded SD3 (flow matching)",
        "",
        "`sd3/`: the SD3 architecture in miniature, a diffusers `StableDiffusion3Pipeline` folder without T5: it loads",
        "with stock `StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)` (diffusers",
        "requires the absent T5 to be passed as None) and with `FlowMatchingPolicy.from_pretrained(folder)`",
        "(`unialign.embedded.shapes_world.load_embedded_sd3`). Built after the assets above (it reuses their VAE):",
        "",
        "```",
        f"python -m tools.build_shapes_world build-sd3 --out unialign/embedded/assets/image --seed {r['seed']} "
        f"--steps {r['steps']} --batch-size {r['batch_size']} --lr {r['lr']:g} --shift {r['shift']:g} "
        f"--per-prompt {r['per_prompt']} --threads {r['threads']}",
        "```",
        "",
        f"* transformer: `SD3Transformer2DModel` on 4x8x8 latents, patch 2 (16 image tokens), width 64 (4 heads x 16), "
        f"{r['layers']} joint blocks, {r['transformer_params']:,} parameters;",
        "* text: two `CLIPTextModelWithProjection` (hidden 32, projection 32; the shipped tokenizer), trained jointly",
        "  from scratch; no T5: the conditioning is both encoders' penultimate states (16 tokens x 64) followed by",
        f"  {r['max_sequence_length']} zero tokens (`SD3_MAX_SEQUENCE_LENGTH`: stock calls must pass "
        f"`max_sequence_length={r['max_sequence_length']}`), pooled = both projected pooled outputs (64);",
        "* VAE: the `sdxl` VAE's weights and `scaling_factor`, with `shift_factor` 0.0 (decodes the same images);",
        f"* scheduler: `FlowMatchEulerDiscreteScheduler`, shift {r['shift']:g} (the first build sampled with shift 3 at "
        "10 steps: held-out 0.542 / 0.726, training 0.589 / 0.827 at CFG 1 / 3, no better and a smaller CFG gap);",
        f"* training: rectified flow (x_s = (1 - s) x0 + s eps, target eps - x0, s logit-normal(0, 1)), "
        f"{r['steps']} steps, batch {r['batch_size']}, AdamW lr {r['lr']:g} (one-cycle), prompt dropped to the empty "
        f"prompt with p 0.1, on the {r['train_images']} training images ({r['per_prompt']} per training prompt).",
        "",
        "| quantity | value |",
        "|---|---:|",
        f"| build (data + training, one CPU thread) | {r['timings_s']['build']:.1f} s |",
        f"| fidelity evaluation below | {r['timings_s']['eval']:.1f} s |",
        f"| final training loss (EMA 0.95) | {r['final_loss']:.4f} |",
        f"| `sd3/` size | {r['size_bytes']:,} bytes |",
        f"| all image assets | {sum(sizes.values()):,} bytes |",
        "",
        "Prompt fidelity (shape verifier, all three right), 168 samples per cell (prompts cycled), seed "
        f"{r['seed']}, `FlowMatchingPolicy` SDE sampler (`sde_type` \"sde\", noise level 0.7):",
        "",
        "| prompts | " + " | ".join(f"CFG {w} ({n} steps)" for n in steps for w in (1, 3)) + " |",
        "|---|" + "---:|" * (2 * len(steps)),
    ]
    for split, name in (("train", "training"), ("test", "held-out")):
        cells = [f"{f[f'{split}_cfg{w}_steps{n}']:.3f}" for n in steps for w in (1, 3)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


@torch.no_grad()
def evaluate(path: str | Path | None = None, n: int = 64, seed: int = 0, split: str = "train", n_groups: int = 16,
             group: int = 8, **policy_kwargs: Any) -> dict[str, Any]:
    """Sample ``n`` images (``SAMPLING_DEFAULTS``) for prompts of ``split`` cycled in order; report the
    mean/std of the embedded aesthetic reward, the CLIP score and ``gold_score``, and the Pearson
    correlation of aesthetic reward with gold."""
    from unialign.embedded.shapes_world import aesthetic_reward, clip_score_reward

    policy = load_embedded(path, **policy_kwargs)
    plist = prompts(split)
    batch = [plist[(i * 7) % len(plist)] for i in range(n)]
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    images = policy.sample(batch, generator=gen).completions
    sample_s = time.perf_counter() - t0
    aesthetic = torch.tensor(aesthetic_reward(path)(prompts=batch, completions=images))
    clip_score = torch.tensor(clip_score_reward(path)(prompts=batch, completions=images))
    gold = gold_score(images)
    data_gold = gold_score([d.image for d in shape_dataset(split, per_prompt=1, seed=seed + 1)])

    def corr(a: Tensor, b: Tensor) -> float:
        return float(torch.corrcoef(torch.stack([a.float(), b.float()]))[0, 1])

    # within a prompt (what per-prompt advantages see): n_groups prompts x group samples, centred per prompt
    groups = [plist[(i * 11) % len(plist)] for i in range(n_groups)]
    batch_g = [p for p in groups for _ in range(group)]
    images_g = policy.sample(batch_g, generator=gen).completions
    aes_g = torch.tensor(aesthetic_reward(path)(prompts=batch_g, completions=images_g)).view(n_groups, group)
    gold_g = gold_score(images_g).view(n_groups, group)
    within = corr((aes_g - aes_g.mean(1, keepdim=True)).flatten(), (gold_g - gold_g.mean(1, keepdim=True)).flatten())

    return {"n": n, "sample_seconds": sample_s, "aesthetic_mean": float(aesthetic.mean()),
            "fidelity": prompt_fidelity(path, seed=seed),
            "corr_aesthetic_gold_within_prompt": within, "within_prompt_groups": f"{n_groups}x{group}",
            "aesthetic_within_prompt_std": float(aes_g.std(1).mean()), "gold_within_prompt_std": float(gold_g.std(1).mean()),
            "aesthetic_std": float(aesthetic.std()), "gold_mean": float(gold.mean()), "gold_std": float(gold.std()),
            "corr_aesthetic_gold": corr(aesthetic, gold), "clip_score_mean": float(clip_score.mean()),
            "clip_score_std": float(clip_score.std()), "dataset_gold_mean": float(data_gold.mean()),
            "dataset_gold_std": float(data_gold.std())}


@torch.no_grad()
def prompt_fidelity(path: str | Path | None = None, n: int = 168, seed: int = 0) -> dict[str, float]:
    """The shape verifier's all-three-right rate (``unialign.embedded.shape_verifier``) of ``n`` samples (prompts
    cycled, 8 DDIM steps, eta 1) per split and CFG 1 / 3, and of VAE round trips of one clean render of
    every prompt (the ceiling any policy on this VAE starts from)."""
    from unialign.embedded.shape_verifier import verify

    out: dict[str, float] = {}
    for guidance in (1.0, 3.0):
        policy = load_embedded(path, num_steps=8, guidance_scale=guidance, eta=1.0)
        for split in ("train", "test"):
            plist = prompts(split)
            batch = [plist[i % len(plist)] for i in range(n)]
            images = policy.sample(batch, generator=torch.Generator().manual_seed(seed)).completions
            out[f"{split}_cfg{guidance:g}"] = float(verify(batch, images)["all"].mean())
    data = shape_dataset("all", per_prompt=1, seed=seed + 1)
    latents = policy.encode_images(to_tensor([d.image for d in data]) * 2 - 1, sample_posterior=False)
    out["vae_round_trip"] = float(verify([d.prompt for d in data], policy.decode(latents))["all"].mean())
    return out


# ---------------------------------------------------------------------------------------------
# The check: a stage rebuilt in a temp folder against the shipped files
# ---------------------------------------------------------------------------------------------
LEGACY_NAME = "unialign.embedded.shapes_build"  # where this module lived when the shipped BUILD.md was written
MODULE_NAME = "tools.build_shapes_world"
# stage -> (the shipped files it writes, the shipped files it starts from)
STAGES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "data": (("tokenizer/", "prompts.json"), ()),
    "clip": (("tokenizer/", "prompts.json", "clip/"), ()),
    "sdxl": (("tokenizer/", "prompts.json", "sdxl/"), ()),
    "head": (("aesthetic_head.pth",), ("tokenizer/", "clip/", "sdxl/")),
    "sd3": (("sd3/",), ("tokenizer/", "sdxl/")),
    "all": (("",), ()),
}
OTHER_BUILDERS = ("reader/",)  # shipped here, built by another tool (tools.build_shape_reader): never compared here
REPORT_TIMINGS = ("timings_s", "eval.sample_seconds", "sd3.timings_s")  # build_report.json's wall-clock fields


def mask_page_timings(page: str) -> str:
    """``BUILD.md`` with its wall-clock numbers replaced by ``#`` (the last cell of the "Build" table's rows, the
    sampling time, the SD3 build and evaluation rows) and the module's old name read as its new one: what a
    rebuild must reproduce byte for byte."""
    out, in_build_table = [], False
    for line in page.replace(LEGACY_NAME, MODULE_NAME).split("\n"):
        if line.startswith("## "):
            in_build_table = line.startswith("## Build (wall seconds")
        if (in_build_table and line.startswith("| ") and not line.startswith(("| stage ", "|---"))) or \
                line.startswith(("| build (data + training", "| fidelity evaluation below |")):
            line = re.sub(r"[\d.]+(?=\**( s)? \|$)", "#", line)
        elif line.startswith("Sampling the "):
            line = re.sub(r"took [\d.]+ s", "took # s", line)
        out.append(line)
    return "\n".join(out)


def shipped_arguments(shipped: str | Path = DEFAULT_ASSET_DIR) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword arguments of ``build`` and ``build_sd3`` that made the shipped assets (``build_report.json``)."""
    r = json.loads((Path(shipped) / "build_report.json").read_text())
    build_kw = dict(seed=r["seed"], clip_steps=r["steps"]["clip"], head_steps=r["steps"]["head"],
                    vae_steps=r["steps"]["vae"], unet_steps=r["steps"]["unet"], per_prompt=r["per_prompt"],
                    threads=r["threads"], n_eval=r["eval"]["n"])
    s = r["sd3"]
    sd3_kw = dict(seed=s["seed"], steps=s["steps"], batch_size=s["batch_size"], per_prompt=s["per_prompt"],
                  threads=s["threads"], shift=s["shift"], lr=s["lr"])
    return build_kw, sd3_kw


def rebuild_stage(stage: str, out: Path, shipped: str | Path = DEFAULT_ASSET_DIR) -> None:
    """Run ``stage`` (``STAGES``) into the empty folder ``out`` with the shipped arguments, its inputs copied from
    ``shipped`` first."""
    import shutil

    if stage not in STAGES:
        raise ValueError(f"stage: {stage!r} is not one of {', '.join(STAGES)}")
    shipped = Path(shipped)
    kw, sd3_kw = shipped_arguments(shipped)
    for name in STAGES[stage][1]:
        shutil.copytree(shipped / name, out / name)
    torch.set_num_threads(kw["threads"])
    if stage == "all":
        build(out, **kw)
        build_sd3(out, **sd3_kw)
    elif stage == "sd3":
        build_sd3_model(out, **sd3_kw)
    elif stage == "head":
        x_N = to_tensor([d.image for d in shape_dataset("train", per_prompt=kw["per_prompt"], seed=kw["seed"])])
        build_head(out, x_N, load_embedded_clip(out).model, kw["head_steps"], kw["seed"])
    else:
        data, x_N, tokenizer = build_data_stage(out, kw["seed"], kw["per_prompt"])
        if stage == "clip":
            build_clip_stage(out, data, x_N, tokenizer, kw["clip_steps"], kw["seed"])
        elif stage == "sdxl":
            build_sdxl_stage(out, data, x_N, tokenizer, kw["vae_steps"], kw["unet_steps"], kw["seed"])


SHIPPED_OUT = Path("unialign/embedded/assets/image")  # the --out of the shipped build, from the repository root


def check(stage: str = "data", shipped: str | Path = DEFAULT_ASSET_DIR, keep: str | Path | None = None) -> Comparison:
    """Rebuild ``stage`` into a temp folder (``keep``: this folder instead, left in place) and compare the files it
    writes with the shipped ones (sha256; the records, written by ``all`` only, without their wall-clock fields:
    ``REPORT_TIMINGS``, ``mask_page_timings``). The stage runs as the shipped build ran, from a root folder with
    ``--out unialign/embedded/assets/image`` (``SHIPPED_OUT``, which must be empty there): a folder a model was
    loaded from is saved in its config (``sd3/vae/config.json``'s ``_name_or_path``)."""
    import os
    import tempfile

    shipped = Path(shipped).resolve()
    with tempfile.TemporaryDirectory(prefix="shapes_world_") as tmp:
        root = Path(keep).resolve() if keep is not None else Path(tmp)
        out = root / SHIPPED_OUT
        out.mkdir(parents=True, exist_ok=True)
        if any(out.iterdir()):
            raise FileExistsError(f"keep: {out} is not empty")
        cwd = os.getcwd()
        os.chdir(root)
        try:
            rebuild_stage(stage, SHIPPED_OUT, shipped)
        finally:
            os.chdir(cwd)
        views = {"build_report.json": json_without(*REPORT_TIMINGS),
                 "BUILD.md": lambda data: mask_page_timings(data.decode())}
        # reader/ (the second fidelity reader) has its own builder and check: tools.build_shape_reader
        return compare(out, shipped, STAGES[stage][0], views=views, skip=files_under(shipped, OTHER_BUILDERS))


def main(argv: list[str] | None = None) -> int:
    parser, sub, b = builder_cli("python -m tools.build_shapes_world", __doc__, "build the assets deterministically",
                                 DEFAULT_ASSET_DIR)
    for name, default in (("clip_steps", 150), ("head_steps", 1500), ("vae_steps", 1000), ("unet_steps", 1000),
                          ("per_prompt", 16), ("threads", 1), ("n_eval", 64)):
        b.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    h = sub.add_parser("build-head", help="re-run only the (last) head stage on the CLIP / model already built")
    h.add_argument("--out", required=True)
    h.add_argument("--seed", type=int, default=0)
    for name, default in (("head_steps", 1500), ("per_prompt", 16), ("threads", 1), ("n_eval", 64)):
        h.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    s = sub.add_parser("build-sd3", help="build the SD3-architecture flow-matching model (after build: reuses its VAE)")
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    for name, default in (("steps", 5000), ("batch_size", 64), ("per_prompt", 16), ("threads", 1)):
        s.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--shift", type=float, default=1.0)
    e = sub.add_parser("eval", help="reward / gold statistics of samples from the embedded model")
    e.add_argument("--path", default=None)
    e.add_argument("--n", type=int, default=64)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--split", default="train")
    m = sub.add_parser("markdown", help="rewrite BUILD.md from build_report.json (no training)")
    m.add_argument("--out", required=True)
    c = add_check(sub, DEFAULT_ASSET_DIR, "rebuild a stage into a temp folder and compare with the shipped files "
                  "(sha256)", f"build into this folder's {SHIPPED_OUT} instead of a temp one, kept")
    c.add_argument("--stage", default="data", choices=tuple(STAGES))
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out, seed=args.seed, clip_steps=args.clip_steps, head_steps=args.head_steps,
              vae_steps=args.vae_steps, unet_steps=args.unet_steps, per_prompt=args.per_prompt, threads=args.threads,
              n_eval=args.n_eval)
    elif args.command == "build-sd3":
        build_sd3(args.out, seed=args.seed, steps=args.steps, batch_size=args.batch_size, per_prompt=args.per_prompt,
                  threads=args.threads, shift=args.shift, lr=args.lr)
    elif args.command == "build-head":
        rebuild_head(args.out, seed=args.seed, head_steps=args.head_steps, per_prompt=args.per_prompt,
                     threads=args.threads, n_eval=args.n_eval)
    elif args.command == "markdown":
        out = Path(args.out)
        (out / "BUILD.md").write_text(build_markdown(json.loads((out / "build_report.json").read_text())))
    elif args.command == "check":
        return report_check(lambda: check(args.stage, args.shipped, args.keep), f"check --stage {args.stage}")
    else:
        print(json.dumps(evaluate(args.path, n=args.n, seed=args.seed, split=args.split), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
