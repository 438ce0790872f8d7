"""The on-policy loop that trains text policies trains a diffusion policy unchanged (DDPO and GRPO presets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import make_tiny_lm
from unialign.text.policy import CausalLMPolicy
from unialign.trainers import OnlineConfig, OnlineTrainer


def brightness(prompts, completions):
    """A pixel reward for the tests: mean brightness in [0, 1]."""
    return [float(np.asarray(img, dtype=np.float32).mean() / 255.0) for img in completions]


def text_length(prompts, completions):
    return [len(c) / 8.0 for c in completions]


@pytest.mark.parametrize("algorithm", ["ddpo", "grpo"])
def test_one_trainer_class_trains_text_and_images(make_policy, tmp_path, algorithm):
    image_policy = make_policy("sdxl", timestep_fraction=0.5)
    text_policy = CausalLMPolicy(*make_tiny_lm(), max_new_tokens=6)
    for policy, reward in ((image_policy, brightness), (text_policy, text_length)):
        cfg = OnlineConfig(algorithm=algorithm, num_generations=2, prompts_per_step=2, micro_batch_size=2,
                           max_steps=2, learning_rate=1e-3, beta=0.0, report_to="none",
                           output_dir=str(tmp_path / type(policy).__name__))
        trainer = OnlineTrainer(policy, reward, [{"prompt": "a red circle"}, {"prompt": "a blue square"}], cfg)
        before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
        history = trainer.train()  # includes the ratio-1 self-check on the first update
        assert trainer.ratio_checked and len(history) == 2
        assert all(np.isfinite(h["reward/mean"]) for h in history)
        moved = [k for k, v in policy.model.named_parameters() if not torch.equal(v, before[k])]
        assert moved, f"{type(policy).__name__}: no parameter changed"
