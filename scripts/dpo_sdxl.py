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
from typing import ClassVar

import torch

from unialign.algos.preference import DPO_LOSS_TYPES
from unialign.config import DTYPES, arg, default, exit_on_user_error, parse_config
from unialign.embedded import parts, register
from unialign.image.families import FAMILY_CHOICES, family_names
from unialign.recipes import presets
from unialign.recipes.args import RunArgs
from unialign.recipes.image import PickapicDataArgs, train_image_pairs
from unialign.trainers.preference import DPOObjective, PreferenceConfig, PreferenceTrainer

PRESETS = presets.DPO_SDXL


@dataclass
class DiffusionDPOConfig(RunArgs, PickapicDataArgs, PreferenceConfig):
    PRESETS: ClassVar[dict] = PRESETS
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
    batch_size: int = default(32)
    micro_batch_size: int = default(32)
    learning_rate: float = default(1e-5)
    max_steps: int = default(120)
    eval_batch_size: int = arg(64, "pairs per held-out evaluation batch")
    output_dir: str = arg("outputs/dpo_sdxl", "where checkpoints, grids, curves, summary.json and final/ go")




def main(cfg: DiffusionDPOConfig) -> dict:
    register()  # the demo worlds by name: data set 'embedded', the shape verifiers, GenEval's 'shapes' backend
    start = time.time()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    p = parts.image_pair_parts(cfg)  # the policy, the pairs (checked before it loads), the held-out images
    trainer = PreferenceTrainer(DPOObjective(p["policy"], cfg.beta, cfg.loss_type), p["train"], cfg,
                                eval_rows=p["held_out"])
    counts = {"train_pairs": len(p["train"]), "ties_dropped": p["ties"], "num_eval_pairs": len(p["held_out"])}
    return train_image_pairs(cfg, trainer, p["held_out"], p["images"], p["own_data"], counts, p["data_info"], start)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(DiffusionDPOConfig))
