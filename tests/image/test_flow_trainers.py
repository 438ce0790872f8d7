"""The one online trainer (DDPO, GRPO) and the one preference trainer (Diffusion-DPO through the shared
``algos.dpo_loss``) train both flow-matching families unchanged: tiny SD3 (``FlowMatchingPolicy``) and tiny
FLUX (``FluxPolicy``), LoRA rank 2, each run moving the weights with a finite logged loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from tests.image.test_flow_policy import T5_TOKENS as SD3_T5_TOKENS
from tests.image.test_flow_policy import sd3_components
from tests.image.test_flux_policy import FLUX_DEFAULTS, flux_components
from unialign.image.flow_policy import FlowMatchingPolicy
from unialign.image.flux_policy import FluxPolicy
from unialign.trainers import OnlineConfig, OnlineTrainer
from unialign.trainers.preference import DPOObjective, PreferenceConfig, PreferenceTrainer

PROMPTS = ["a red circle", "a blue square"]


def make(family: str, tokenizer_dir, **kwargs):
    if family == "sd3":
        opts = dict(num_steps=3, guidance_scale=3.0, noise_level=0.7, max_sequence_length=SD3_T5_TOKENS, lora_rank=2)
        return FlowMatchingPolicy(**sd3_components(tokenizer_dir), **{**opts, **kwargs})
    return FluxPolicy(**flux_components(tokenizer_dir), **{**FLUX_DEFAULTS, "num_steps": 3, "lora_rank": 2, **kwargs})


def brightness(prompts, completions):
    return [float(np.asarray(img, dtype=np.float32).mean() / 255.0) for img in completions]


def trainable(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def moved(policy, before: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, p in policy.model.named_parameters() if n in before and not torch.equal(p, before[n])]


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("algorithm", ["ddpo", "grpo"])
def test_online_algorithms_train_both_families(tokenizer_dir, tmp_path, family, algorithm):
    policy = make(family, tokenizer_dir, sde_window_size=2)
    cfg = OnlineConfig(algorithm=algorithm, num_generations=2, prompts_per_step=2, micro_batch_size=4, max_steps=1,
                       learning_rate=1e-2, beta=0.0, report_to="none", output_dir=str(tmp_path))
    trainer = OnlineTrainer(policy, brightness, [{"prompt": p} for p in PROMPTS], cfg)
    before = trainable(policy)
    history = trainer.train()  # includes the ratio-1 self-check on the first update
    assert trainer.ratio_checked and len(history) == 1
    assert np.isfinite(history[0]["loss"]) and np.isfinite(history[0]["reward/mean"])
    assert before and moved(policy, before), f"{family}/{algorithm}: no parameter changed"


def preference_rows(n: int = 4) -> list[dict]:
    return [{"prompt": PROMPTS[i % 2], "chosen": Image.new("RGB", (16, 16), (220, 40 * i, 30)),
             "rejected": Image.new("RGB", (16, 16), (30, 60, 40 * i))} for i in range(n)]


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_diffusion_dpo_trains_both_families(tokenizer_dir, tmp_path, family):
    policy = make(family, tokenizer_dir, caption_dropout=0.2)
    cfg = PreferenceConfig(batch_size=4, micro_batch_size=2, max_steps=2, learning_rate=1e-2, report_to="none",
                           output_dir=str(tmp_path))
    before = trainable(policy)
    history = PreferenceTrainer(DPOObjective(policy, beta=5000.0), preference_rows(), cfg).train()
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    # policy = reference at the first step (LoRA B = 0): ln 2 up to the float noise that beta = 5000 amplifies
    assert abs(history[0]["loss"] - math.log(2)) < 1e-4
    assert history[1]["loss"] != history[0]["loss"]
    assert moved(policy, before), f"{family}: DPO moved no parameter"
