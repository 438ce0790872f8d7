"""Diffusion-DPO (Wallace et al. 2023) on SDXL / SD1.x: the same ``dpo_loss`` as text DPO, on the ELBO surrogate.

    accelerate launch scripts/dpo_sdxl.py                          # offline: embedded tiny SDXL, pairs ranked by gold score
    accelerate launch scripts/dpo_sdxl.py --preset sdxl-pickapic --dataset_name PATH_OR_ID

Data in Pick-a-Pic's schema (caption, jpg_0, jpg_1, label_0; ties dropped and counted). Writes
<output_dir>/summary.json: gold score of fresh held-out samples before/after (embedded), held-out
implicit accuracy before/after, the first logged loss (ln 2 at init), grids and curves.

Embedded default (numbers in the README): pairs of samples of a training caption, the higher gold score
chosen, ties (gap < ``min_gap``) dropped; beta 5000, full UNet, caption dropout 0.1, lr 1e-5. Held-out
implicit accuracy averages ``eval_timestep_samples`` (t, eps) draws (one draw: ``..._k1``); prompt fidelity
(shape verifier) of fixed held-out samples is reported before and after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unialign.config import exit_on_user_error, parse_config
from unialign.image import DiffusionPolicy
from unialign.image.data import normalize_pickapic, synthetic_pairs
from unialign.image.grid import save_grid
from unialign.text import load_rows
from unialign.trainers import finish_run
from unialign.trainers.preference import (
    DPOObjective,
    PreferenceConfig,
    PreferenceTrainer,
    averaged_implicit_accuracy,
)


@dataclass
class DiffusionDPOConfig(PreferenceConfig):
    preset: str | None = field(default=None, metadata={"help": "sdxl-pickapic"})
    config: str | None = field(default=None, metadata={"help": "YAML file of field values"})
    model_name_or_path: str = "embedded"
    vae_name_or_path: str | None = None
    dataset_name: str = field(default="embedded", metadata={"help": "Pick-a-Pic-schema hub id / parquet, or 'embedded'"})
    train_split: str = "train"
    eval_split: str = "validation"
    num_eval: int = 256
    num_eval_images: int = field(default=168, metadata={
        "help": "embedded: held-out images (held-out prompts cycled, seed 1234) for gold score and prompt fidelity"})
    pairs_per_prompt: int = 4
    num_prompts: int | None = field(default=None, metadata={"help": "embedded: use only the first N training captions"})
    eval_pairs_per_prompt: int = field(default=2, metadata={"help": "embedded: held-out pairs per training caption"})
    min_gap: float = field(default=0.02, metadata={"help": "embedded: gold-score gap below which a pair is a tie"})
    eval_timestep_samples: int = field(
        default=8, metadata={"help": "held-out implicit accuracy: average the surrogate over K (t, eps) draws"})
    beta: float = 5000.0
    loss_type: str = "sigmoid"
    caption_dropout: float = 0.1
    resolution: int | None = None
    lora_rank: int = 0
    gradient_checkpointing: bool = False
    torch_dtype: str = "float32"
    num_threads: int | None = 1
    batch_size: int = 32
    micro_batch_size: int = 32
    learning_rate: float = 1e-5
    max_steps: int = 120
    eval_batch_size: int = 64
    output_dir: str = "outputs/dpo_sdxl"


PRESETS = {
    # SalesforceAIResearch/DiffusionDPO launchers/sdxl.sh: beta 5000, fp16-fix VAE, effective lr 2.048e-5
    "sdxl-pickapic": dict(
        model_name_or_path="stabilityai/stable-diffusion-xl-base-1.0", vae_name_or_path="madebyollin/sdxl-vae-fp16-fix",
        dataset_name="yuvalkirstain/pickapic_v2", eval_split="validation_unique", beta=5000.0, caption_dropout=0.2,
        resolution=1024, lora_rank=64, learning_rate=2e-5, batch_size=64, micro_batch_size=1, max_steps=2000,
        warmup_steps=200, lr_scheduler_type="constant", optim="adafactor", weight_decay=1e-2, gradient_checkpointing=True,
        torch_dtype="float16",
        num_threads=None, output_dir="outputs/dpo_sdxl_pickapic"),
}


def main(cfg: DiffusionDPOConfig) -> dict:
    start = time.time()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    embedded = cfg.model_name_or_path == "embedded"
    opts = dict(lora_rank=cfg.lora_rank, caption_dropout=cfg.caption_dropout, seed=cfg.seed,
                gradient_checkpointing=cfg.gradient_checkpointing)
    if embedded:
        from unialign.image import embedded as emb

        policy = emb.load_embedded(**opts)
    else:
        policy = DiffusionPolicy.from_pretrained(cfg.model_name_or_path, vae_name_or_path=cfg.vae_name_or_path,
                                                 torch_dtype=cfg.torch_dtype, **opts)
    if cfg.dataset_name == "embedded":  # AI feedback: two samples per caption, the higher gold score wins
        from unialign.image import embedded as emb

        train_prompts = emb.prompts("train")[:cfg.num_prompts]
        train_rows = synthetic_pairs(policy, train_prompts, emb.gold_score, cfg.pairs_per_prompt, cfg.seed + 1,
                                     cfg.min_gap)
        eval_rows = synthetic_pairs(policy, train_prompts, emb.gold_score, cfg.eval_pairs_per_prompt, cfg.seed + 2,
                                    cfg.min_gap)
        eval_rows = [r for r in eval_rows if r["label_0"] != 0.5][:cfg.num_eval]  # ties dropped before the cap
    else:
        train_rows = load_rows(cfg.dataset_name, cfg.train_split)
        eval_rows = load_rows(cfg.dataset_name, cfg.eval_split)[:cfg.num_eval]
    train, ties = normalize_pickapic(train_rows, "train")
    held_out, _ = normalize_pickapic(eval_rows, "eval")
    objective = DPOObjective(policy, cfg.beta, cfg.loss_type)
    trainer = PreferenceTrainer(objective, train, cfg)

    held_out_images = None
    if embedded:  # fixed held-out prompts and seed: the same draws before and after
        from unialign.image.evaluate import HeldOutImages
        from unialign.rewards.shapes import verify

        test = emb.prompts("test")
        held_out_images = HeldOutImages(policy, [test[i % len(test)] for i in range(cfg.num_eval_images)], 1234,
                                        gold=emb.gold_score, verifier=verify)

    def evaluate(name: str) -> tuple[dict, float, float]:  # held-out images (embedded), implicit accuracy K / 1
        images = held_out_images() if held_out_images else {}
        if held_out_images and trainer.acc.is_main_process:
            save_grid(held_out_images.last["images"], held_out_images.captions(), Path(cfg.output_dir) / f"grid_{name}.png")
        k1 = trainer.evaluate(held_out)["implicit_accuracy"]
        k = cfg.eval_timestep_samples
        return images, (k1 if k <= 1 else averaged_implicit_accuracy(objective, held_out, k, cfg.eval_batch_size)), k1

    before, implicit_before, implicit_before_k1 = evaluate("before")
    history = trainer.train()
    after, implicit_after, implicit_after_k1 = evaluate("after")
    summary = {"metric": "gold_score" if embedded else "implicit_accuracy",
               "before": before["gold"] if embedded else implicit_before,
               "after": after["gold"] if embedded else implicit_after,
               "implicit_accuracy_before": implicit_before, "implicit_accuracy_after": implicit_after,
               **({"fidelity_before": before["fidelity"], "fidelity_after": after["fidelity"]} if embedded else {}),
               "implicit_accuracy_before_k1": implicit_before_k1, "implicit_accuracy_after_k1": implicit_after_k1,
               "eval_timestep_samples": cfg.eval_timestep_samples,
               "first_loss": history[0]["loss"] if history else None, "steps": trainer.step,
               "train_pairs": len(train), "ties_dropped": ties, "num_eval_pairs": len(held_out),
               "wall_seconds": time.time() - start}
    return finish_run(trainer.acc, cfg, summary, policy.save)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(DiffusionDPOConfig, presets=PRESETS))
