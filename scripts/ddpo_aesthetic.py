"""DDPO (and GRPO / DAPO / GSPO on images via --algorithm) on an aesthetic reward.

    accelerate launch scripts/ddpo_aesthetic.py                         # offline embedded default, CPU, minutes
    accelerate launch scripts/ddpo_aesthetic.py --preset sd15-aesthetic # SD1.5 + LAION aesthetic, ddpo-pytorch recipe

The same OnlineTrainer as scripts/grpo_math.py trains a DiffusionPolicy whose steps are denoising
transitions. Writes <output_dir>/summary.json (held-out reward before/after on fixed seeds, and for the
embedded model the pixel-level gold score), grid_before.png / grid_after.png and reward_curve.png.

Embedded default (no arguments): the DDPO preset, full fine-tune of the tiny UNet at lr 1e-3, 30 steps of
4 prompts x 16 samples, 8 DDIM steps without CFG, 2 of 8 steps trained per sample, 1 CPU thread; about
3 minutes on a shared 2-core machine (measured: held-out reward 0.621 -> 0.764, before-std 0.131; gold
0.619 -> 0.744; 182 s at load average ~6). The reward is the shipped aesthetic head, trained on the model's own output
space (see unialign/image/embedded.py). What it learns, honestly: the held-out reward and the pixel gold
score both rise by about one before-std, by collapsing towards one warm, saturated, high-contrast
orange/yellow/dark texture for every prompt (the aesthetic reward ignores the prompt, as LAION's does;
DDPO on it drifts the same way at scale). Shapes and prompt colours are largely lost: read the grids.
Lower learning rates (1e-4 - 3e-4) keep the shapes but move reward and gold by well under one std in
this budget; the path at 1e-3 dips for ~10 steps before climbing, and plateaus after ~25 steps (45 steps
ended at +0.95 std), so 30 is tuned, not generous.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from unialign.config import exit_on_user_error, parse_config
from unialign.image import DiffusionPolicy
from unialign.image.evaluate import sample_scores
from unialign.image.grid import save_grid
from unialign.rewards import get_reward
from unialign.trainers import OnlineConfig, OnlineTrainer, write_json_atomic

# ddpo-pytorch's "simple animals" prompt list (config/base.py -> assets/simple_animals.txt, abridged)
ANIMALS = ["cat", "dog", "horse", "monkey", "rabbit", "zebra", "spider", "bird", "sheep", "deer", "cow", "goat",
           "lion", "tiger", "bear", "raccoon", "fox", "wolf", "lizard", "beetle", "ant", "butterfly", "fish",
           "shark", "whale", "dolphin", "squirrel", "mouse", "rat", "snake", "turtle", "frog", "chicken", "duck",
           "goose", "bee", "pig", "turkey", "fly", "llama", "camel", "bat", "gorilla", "hedgehog", "kangaroo"]


# how each model-based reward loads the shipped tiny CLIP / aesthetic head instead of hub weights
EMBEDDED_REWARDS = {"aesthetic": {"clip_model": "embedded"}, "clip_score": {"model_name": "embedded"}}


@dataclass
class DDPOAestheticConfig(OnlineConfig):
    preset: str | None = field(default=None, metadata={"help": "sd15-aesthetic"})
    config: str | None = field(default=None, metadata={"help": "YAML file of field values"})
    model_name_or_path: str = field(default="embedded", metadata={"help": "SD1.x/SDXL hub id, local dir, or 'embedded'"})
    prompt_set: str = field(default="embedded", metadata={"help": "'embedded', 'animals', or a .txt file"})
    reward: str = field(default="aesthetic", metadata={"help": "registry name (aesthetic, clip_score, jpeg_...)"})
    # embedded-default sampling: 8 DDIM steps, no CFG (guidance 1: half the UNet calls, and 2-3x the
    # within-prompt reward spread of CFG 3, which is what per-prompt advantages learn from)
    num_steps: int = 8
    guidance_scale: float = 1.0
    eta: float = 1.0
    resolution: int | None = None
    timestep_fraction: float = 0.25
    lora_rank: int = 0
    torch_dtype: str = "float32"
    num_eval: int = 32
    eval_seed: int = 1234
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads (tiny models: 1 is fastest; <= 0 leaves torch's)"})
    # embedded-default training knobs: the ddpo preset (per-prompt stat tracking, adv clip 5) with
    # num_generations >= its stat_min_count (16), so every prompt is normalised by its own samples from
    # its first visit (with 8, prompts fall back to batch statistics and the advantage is mostly "which
    # prompt was drawn", i.e. noise for the policy); two mini-batches per batch, so the second update is
    # off-policy and the clip matters: 1e-2 on these mean-reduced 4x8x8 step log-probs clips ~2-5% of steps.
    algorithm: str = "ddpo"
    learning_rate: float = 1e-3
    prompts_per_step: int = 4
    num_generations: int = 16
    num_mini_batches: int = 2
    epsilon: float | None = 1e-2
    micro_batch_size: int = 32
    max_steps: int = 30
    output_dir: str = "outputs/ddpo_aesthetic"


PRESETS = {
    # ddpo-pytorch config/dgx.py:aesthetic -- 50 DDIM steps, eta 1, CFG 5, LoRA, lr 3e-4, clip 1e-4, adv clip 5
    "sd15-aesthetic": dict(
        model_name_or_path="runwayml/stable-diffusion-v1-5", prompt_set="animals", reward="aesthetic", num_steps=50,
        guidance_scale=5.0, eta=1.0, resolution=512, lora_rank=4, learning_rate=3e-4, prompts_per_step=32,
        num_generations=8, micro_batch_size=4, max_steps=200, num_eval=64, torch_dtype="float16",
        timestep_fraction=1.0, num_mini_batches=1, epsilon=1e-4, num_threads=0,
        output_dir="outputs/ddpo_sd15_aesthetic"),
}


def load_prompts(name: str, split: str) -> list[str]:
    if name == "embedded":
        from unialign.image import embedded

        return embedded.prompts(split)
    if name == "animals":
        return ANIMALS
    lines = [ln.strip() for ln in Path(name).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"prompt file {name!r} has no prompts")
    return lines


def main(cfg: DDPOAestheticConfig) -> dict:
    start = time.time()
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    embedded = cfg.model_name_or_path == "embedded"
    sizes = {} if cfg.resolution is None else {"height": cfg.resolution, "width": cfg.resolution}
    kwargs = dict(num_steps=cfg.num_steps, guidance_scale=cfg.guidance_scale, eta=cfg.eta,
                  timestep_fraction=cfg.timestep_fraction, lora_rank=cfg.lora_rank, seed=cfg.seed, **sizes)
    gold = None
    if embedded:
        from unialign.image import embedded as emb

        policy = emb.load_embedded(**kwargs)
        reward = get_reward(cfg.reward, **EMBEDDED_REWARDS.get(cfg.reward, {}))
        gold = emb.gold_score
    else:
        policy = DiffusionPolicy.from_pretrained(cfg.model_name_or_path, torch_dtype=cfg.torch_dtype, **kwargs)
        reward = get_reward(cfg.reward)
    train = [{"prompt": p} for p in load_prompts(cfg.prompt_set, "train")]
    held_out = load_prompts(cfg.prompt_set, "test")
    eval_prompts = [held_out[i % len(held_out)] for i in range(cfg.num_eval)]

    trainer = OnlineTrainer(policy, reward, train, cfg)
    out_dir = Path(cfg.output_dir)
    before = sample_scores(policy, eval_prompts, cfg.eval_seed, reward, gold)
    history = trainer.train()
    after = sample_scores(policy, eval_prompts, cfg.eval_seed, reward, gold)
    summary = {"metric": "reward", "reward": cfg.reward, "before": before["mean"], "after": after["mean"],
               "before_std": before["std"], "after_std": after["std"], "steps": trainer.step,
               "wall_seconds": time.time() - start, "num_eval": len(eval_prompts),
               "final_train_reward": history[-1].get("reward/mean") if history else None}
    if gold is not None:
        summary.update(gold_before=before["gold_mean"], gold_after=after["gold_mean"])
    summary["config"] = {k: v for k, v in asdict(cfg).items() if v is not None}
    if trainer.acc.is_main_process:
        for name, res in (("before", before), ("after", after)):
            save_grid(res["images"], [f"{p} | {s:.3f}" for p, s in zip(eval_prompts, res["scores"].tolist())],
                      out_dir / f"grid_{name}.png")
        policy.save(str(out_dir / "final"))
        write_json_atomic(out_dir / "summary.json", summary)
        trainer.acc.print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=1))
    return summary


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(DDPOAestheticConfig, presets=PRESETS))
