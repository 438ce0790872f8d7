"""Diffusion-DPO (Wallace et al. 2023) on SDXL / SD1.x, and on flow matching (SD3 / FLUX.1): the same ``dpo_loss``
as text DPO, on the ELBO surrogate (noise- or velocity-prediction MSE at one shared t and noise per pair).

    accelerate launch scripts/dpo_sdxl.py                          # offline: embedded tiny SDXL, pairs ranked by gold score
    accelerate launch scripts/dpo_sdxl.py --model_name_or_path embedded-sd3   # its flow-matching (SD3) twin
    accelerate launch scripts/dpo_sdxl.py --preset sdxl-pickapic --dataset_name PATH_OR_ID

Data in Pick-a-Pic's schema (caption, jpg_0, jpg_1, label_0; ties dropped and counted). Writes summary.json (held-out
implicit accuracy before/after: the share of held-out pairs whose implicit reward, beta x (policy - reference) ELBO
surrogate, ranks chosen first -- the metric on your own pairs; on the embedded pairs the gold score and fidelity of
held-out samples), comparison.png (your held-out captions / the world's test prompts, before | after), final/.

Embedded default (numbers in the README): pairs of samples of a training caption, the higher gold score
chosen, ties (gap < ``min_gap``) dropped; beta 5000, full UNet, caption dropout 0.1, lr 1e-5. Held-out
implicit accuracy averages ``eval_timestep_samples`` (t, eps) draws (one draw: ``..._k1``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from unialign.algos.preference import DPO_LOSS_TYPES
from unialign.config import DTYPES, UserError, arg, exit_on_user_error, parse_config
from unialign.embedded import NAME, parts, register, shapes_world
from unialign.image.data import load_pickapic
from unialign.image.evaluate import HeldOutImages, finish_image_run
from unialign.image.families import FAMILY_CHOICES, family_names
from unialign.image.grid import first_of_each_prompt
from unialign.image.recipe import PickapicDataArgs, load_denoiser
from unialign.trainers.preference import DPOObjective, PreferenceConfig, PreferenceTrainer
from unialign.trainers.preference import averaged_implicit_accuracy as averaged_accuracy


@dataclass
class DiffusionDPOConfig(PickapicDataArgs, PreferenceConfig):
    preset: str | None = arg(None, "named recipe: sdxl-pickapic (flags still override it)", group="config")
    config: str | None = arg(None, "YAML file of field values (flags override it)", group="config")
    model_name_or_path: str = arg("embedded", "SDXL / SD1.x / SD3 / FLUX.1 Hub id or local diffusers folder, or "
                                  "'embedded' / 'embedded-sd3' (the shapes world's SDXL- / SD3-architecture models)",
                                  group="model")
    model_family: str = arg("auto", "auto (the folder's model_index.json, else the hub id) | " + family_names(False),
                            group="model", choices=FAMILY_CHOICES)
    vae_name_or_path: str | None = arg(None, "a VAE to use instead of the model's (e.g. the fp16-fix SDXL VAE)",
                                       group="model")
    dataset_name: str = arg("embedded", "Pick-a-Pic-schema Hub id, .jsonl/.json/.parquet file or folder (images as "
                            "bytes or paths), or 'embedded' (pairs of the model's samples ranked by a gold score)")
    num_eval_images: int = arg(168, "held-out images (seed 1234) before and after: embedded pairs: the world's test "
                               "prompts cycled (gold score, fidelity); your pairs: your first distinct held-out "
                               "captions, at most 32 (comparison.png); 0: none", group="data", min=1)
    pairs_per_prompt: int = arg(4, "embedded: training pairs per caption", group="data", min=1)
    num_prompts: int | None = arg(None, "embedded: use only the first N training captions", group="data", min=1)
    eval_pairs_per_prompt: int = arg(2, "embedded: held-out pairs per training caption", group="data", min=1)
    min_gap: float = arg(0.02, "embedded: gold-score gap below which a pair is a tie", group="data", min=0.0)
    eval_timestep_samples: int = arg(8, "held-out implicit accuracy: average the surrogate over K (t, eps) draws",
                                     group="logging", min=1)
    beta: float = arg(5000.0, "Diffusion-DPO temperature (scales the ELBO-surrogate margin)",
                      group="algorithm", min=0.0)
    loss_type: str = arg("sigmoid", "DPO loss", group="algorithm", choices=DPO_LOSS_TYPES)
    caption_dropout: float = arg(0.1, "share of captions replaced by the empty prompt in training (keeps CFG usable)",
                                 group="data", min=0.0, max=1.0)
    resolution: int | None = arg(None, "image side in pixels (default: the model's)", group="model", min=8)
    lora_rank: int = arg(0, "> 0: train a LoRA of this rank instead of the full UNet", group="model", min=0)
    gradient_checkpointing: bool = arg(False, "recompute UNet activations in the backward pass (less memory)",
                                       group="model")
    torch_dtype: str = arg("float32", "UNet / text-encoder dtype (the VAE runs in fp32)", group="model", choices=DTYPES)
    num_threads: int | None = arg(1, "torch CPU threads (tiny models: 1 is fastest)")
    batch_size: int = arg(32, "pairs per optimizer step")
    micro_batch_size: int = arg(32, "pairs per forward/backward")
    learning_rate: float = arg(1e-5, "peak learning rate")
    max_steps: int = arg(120, "optimizer steps")
    eval_batch_size: int = arg(64, "pairs per held-out evaluation batch")
    output_dir: str = arg("outputs/dpo_sdxl", "where checkpoints, grids, curves, summary.json and final/ go")


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
    register()  # the demo worlds by name: data set 'embedded', the shape verifiers, GenEval's 'shapes' backend
    start = time.time()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    embedded, own_data = cfg.model_name_or_path in parts.IMAGE_MODELS, cfg.dataset_name != NAME
    if embedded:
        parts.embedded_family(cfg.model_name_or_path, cfg.model_family)  # a conflicting --model_family is refused
    if not own_data and not embedded:
        raise UserError("--dataset_name embedded: pairs of the embedded model's own samples ranked by its world's "
                        "gold score; with another --model_name_or_path give a Pick-a-Pic-schema dataset")
    data = load_pickapic(cfg) if own_data else None  # read and checked before the model loads
    opts = dict(lora_rank=cfg.lora_rank, caption_dropout=cfg.caption_dropout, seed=cfg.seed,
                gradient_checkpointing=cfg.gradient_checkpointing)
    if embedded:
        policy = parts.embedded_policy(cfg.model_name_or_path, **opts)
    else:
        policy = load_denoiser(cfg.model_name_or_path, cfg.model_family, cfg.torch_dtype, cfg.vae_name_or_path, **opts)
    train, held_out, ties, data_info = data or parts.image_pairs(policy, cfg)
    data_info.pop("row_ids", None)  # every held-out row's index: reproducible from eval_split_seed, not printed
    objective = DPOObjective(policy, cfg.beta, cfg.loss_type)
    trainer = PreferenceTrainer(objective, train, cfg, eval_rows=held_out)  # --eval_steps: held-out curve
    # fixed held-out prompts and seed, the same draws before and after
    if own_data:  # the first distinct held-out captions of the user's pairs: comparison.png only
        shown = first_of_each_prompt([r["prompt"] for r in held_out], min(cfg.num_eval_images, 32))
        images = HeldOutImages(policy, [held_out[i]["prompt"] for i in shown], 1234, batch_size=8)
    else:  # the world's test prompts: gold score and prompt fidelity
        test = shapes_world.prompts("test")
        images = HeldOutImages(policy, [test[i % len(test)] for i in range(cfg.num_eval_images)], 1234,
                               gold=shapes_world.gold_score, verifier=parts.fidelity_checks)
    results: list[dict] = []

    def evaluate() -> tuple[dict, float, float]:  # held-out images, implicit accuracy K / 1
        metrics = images() if images.prompts else {}
        results.append(images.last)
        k1, k = trainer.evaluate(held_out)["implicit_accuracy"], cfg.eval_timestep_samples
        return metrics, (k1 if k <= 1 else averaged_accuracy(objective, held_out, k, cfg.eval_batch_size)), k1

    before, implicit_before, implicit_before_k1 = evaluate()
    history = [h for h in trainer.train() if "loss" in h]  # training steps (held-out evaluations are eval/* rows)
    after, implicit_after, implicit_after_k1 = evaluate()
    metric = "implicit_accuracy" if own_data else "gold_score"
    summary = {"metric": metric, "before": implicit_before if own_data else before["gold"],
               "after": implicit_after if own_data else after["gold"],
               "implicit_accuracy_before": implicit_before, "implicit_accuracy_after": implicit_after,
               **({} if own_data else {"fidelity_before": before["fidelity"], "fidelity_after": after["fidelity"]}),
               "implicit_accuracy_before_k1": implicit_before_k1, "implicit_accuracy_after_k1": implicit_after_k1,
               "eval_timestep_samples": cfg.eval_timestep_samples,
               "first_loss": history[0]["loss"] if history else None, "steps": trainer.step,
               "train_pairs": len(train), "ties_dropped": ties, "num_eval_pairs": len(held_out),
               "wall_seconds": time.time() - start, **data_info}
    return finish_image_run(trainer.acc, cfg, summary, policy, images, tuple(results),
                            [(f"held-out {metric}", summary["before"], summary["after"])])


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(DiffusionDPOConfig, presets=PRESETS))
