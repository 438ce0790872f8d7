"""SimPO and ORPO on diffusion through the ELBO surrogate: no reference UNet is copied or run, the losses are
the papers' formulas on logp = -1/2 mean_CHW ||eps - eps_theta||^2, and two steps train."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close
from tests.image.test_diffusion_dpo import ROWS
from unialign.image.data import normalize_pickapic
from unialign.trainers.preference import DPOObjective, PreferenceConfig, PreferenceTrainer


@pytest.mark.parametrize("loss_type, beta, params", [("simpo", 5000.0, {"gamma": 0.0}), ("orpo", 0.1, None)])
def test_reference_free_pair_losses_on_the_elbo_surrogate(make_policy, tmp_path, monkeypatch, loss_type, beta, params):
    policy = make_policy("sd")

    def no_reference():
        raise AssertionError("a reference-free loss asked for a reference")

    monkeypatch.setattr(policy, "reference", no_reference)
    objective = DPOObjective(policy, beta=beta, loss_type=loss_type, loss_params=params)
    pairs, _ = normalize_pickapic(ROWS)
    batch = policy.preference_batch(pairs[:3])  # t and noise drawn once, shared by both sides
    with torch.no_grad():
        losses, metrics = objective.losses(batch)
        c, r = (x.double() for x in policy.sequence_log_prob(batch))  # the surrogate, recomputed
    assert (c < 0).all() and (r < 0).all()
    if loss_type == "simpo":  # gamma 0, equal sides at init up to the images: -log sigma(beta (c - r))
        want = -F.logsigmoid(beta * (c - r))
    else:  # ORPO: the odds of p = e^logp, plus the chosen NLL = the chosen side's denoising loss / 2
        odds = lambda x: x - torch.log1p(-torch.exp(x))  # noqa: E731
        want = -c - beta * F.logsigmoid(odds(c) - odds(r))
        assert_close(metrics["nll_loss"], (-c).mean(), dtype=torch.float32)
    assert_close(losses, want, dtype=torch.float32)
    cfg = PreferenceConfig(batch_size=6, micro_batch_size=3, max_steps=2, learning_rate=1e-3, report_to="none",
                           output_dir=str(tmp_path))
    history = PreferenceTrainer(objective, pairs, cfg).train()
    assert all(math.isfinite(h["loss"]) for h in history if "loss" in h)
    assert history[1]["loss"] != history[0]["loss"]
    assert policy._frozen_denoiser is None  # no frozen copy of the UNet was made
