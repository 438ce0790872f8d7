"""KL to the reference for diffusion policies, against an independent float64 restatement of the DDIM step
on direct UNet calls: the closed form mean_CHW (mu - mu_ref)^2 / (2 sigma_t^2) and the sample estimators on
the per-step log-probs; then what each does to training."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import assert_close
from unialign.algos import kl_estimate
from unialign.trainers import OnlineConfig, OnlineTrainer

PROMPTS = ["a cat", "a dog", "a cat", "a dog"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _perturb(params, scale: float, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


def _step_gaussians(policy, unet, traj) -> tuple[np.ndarray, np.ndarray]:
    """(mu [B, N, C, H, W], sigma [B, N]) in float64 from direct UNet calls (no CFG: guidance 1) and the
    DDIM formulas (12), (16) written out here from the scheduler's alphas_cumprod."""
    payload = traj.payload
    latents, timesteps = payload["latents"], payload["timesteps"]
    acp = policy.scheduler.alphas_cumprod.double().numpy()
    step = policy.scheduler.config.num_train_timesteps // policy.num_steps
    means, stds = [], []
    for j in range(timesteps.shape[1]):
        x, t = latents[:, j], timesteps[:, j]
        added = None
        if policy.is_sdxl:
            added = {"text_embeds": payload["pooled_prompt_embeds"], "time_ids": payload["time_ids"]}
        with torch.no_grad():
            eps = unet(x, t, encoder_hidden_states=payload["prompt_embeds"], added_cond_kwargs=added).sample
        eps, x = eps.double().numpy(), x.double().numpy()
        a = acp[t.numpy()][:, None, None, None]
        a_prev = acp[np.clip(t.numpy() - step, 0, None)][:, None, None, None]
        sigma = policy.eta * np.sqrt((1 - a_prev) / (1 - a) * (1 - a / a_prev))
        x0 = (x - np.sqrt(1 - a) * eps) / np.sqrt(a)
        means.append(np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev - sigma**2) * eps)
        stds.append(sigma[:, 0, 0, 0])
    return np.stack(means, 1), np.stack(stds, 1)


def _gauss_logp(x, mu, sigma):
    s = sigma[..., None, None, None]
    return (-((x - mu) ** 2) / (2 * s**2) - np.log(s) - 0.5 * np.log(2 * np.pi)).mean(axis=(2, 3, 4))


@pytest.mark.parametrize("kind, lora_rank", [("sd", 2), ("sdxl", 2), ("sd", 0)])
def test_closed_form_and_sample_estimators_match_an_independent_computation(make_policy, kind, lora_rank):
    policy = make_policy(kind, lora_rank=lora_rank, guidance_scale=1.0)
    reference = policy.reference()  # before any change: adapters off, or the frozen copy
    trainable = list(policy.trainable_parameters())
    _perturb([p for n, p in policy.unet.named_parameters() if "lora_B" in n] if lora_rank else trainable, 0.02)
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(0))

    logp, entropy, kl = policy.log_prob_and_kl(traj)
    assert logp.shape == kl.shape == (4, policy.num_steps) and kl.requires_grad

    mu, sigma = _step_gaussians(policy, policy.unet, traj)
    if lora_rank:
        policy.unet.disable_adapters()
        mu_ref, _ = _step_gaussians(policy, policy.unet, traj)
        policy.unet.enable_adapters()
    else:
        mu_ref, _ = _step_gaussians(policy, reference.model, traj)
    x_next = traj.payload["latents"][:, 1:].double().numpy()
    expected_kl = ((mu - mu_ref) ** 2).mean(axis=(2, 3, 4)) / (2 * sigma**2)
    assert expected_kl.min() > 0
    assert_close(kl, expected_kl, dtype=torch.float32)
    assert_close(logp, _gauss_logp(x_next, mu, sigma), dtype=torch.float32)
    assert_close(logp, traj.old_logp_B_T)  # the KL path computes the same log-probs as sampling did

    # the sample estimators (k1 / k2 / k3: tests/algos/test_kl.py) take these per-step log-probs and the
    # reference's, which must be the reference's Gaussian density of the recorded step
    assert_close(reference.log_prob(traj), _gauss_logp(x_next, mu_ref, sigma), dtype=torch.float32)

    # gradients of the KL reach exactly the trainable weights
    kl.sum().backward()
    assert all(p.grad is not None for p in trainable) and sum(float(p.grad.abs().sum()) for p in trainable) > 0


def test_kl_is_zero_at_the_reference_and_masked_steps_are_skipped(make_policy):
    policy = make_policy("sdxl", lora_rank=2, timestep_fraction=0.5)  # lora_B = 0: policy == reference
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(1))
    logp, _, kl = policy.log_prob_and_kl(traj)
    assert float(kl.detach().abs().max()) == 0.0
    assert torch.equal(logp == 0, traj.mask_B_T == 0)


def test_on_mean_reduced_steps_k1_tracks_the_closed_form_k3_is_second_order(make_policy):
    """Why ``gaussian`` is the image default (``unialign.algos.kl`` docstring): averaged over C,H,W the
    per-step log-ratio concentrates at the per-element KL, so k1 ~ KL while k3 ~ (KL^2 + 2 KL / D) / 2
    (measured here: k1 / KL = 1.0, k3 / KL = 0.02)."""
    policy = make_policy("sd", lora_rank=2, guidance_scale=1.0)
    _perturb([p for n, p in policy.unet.named_parameters() if "lora_B" in n], 0.05)
    traj = policy.sample(PROMPTS * 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logp, _, kl = policy.log_prob_and_kl(traj)
        ref_logp = policy.reference().log_prob(traj)
    closed, k1 = float(kl.mean()), float(kl_estimate(logp, ref_logp, "k1").mean())
    k3 = float(kl_estimate(logp, ref_logp, "k3").mean())
    assert 0.5 * closed < k1 < 2.0 * closed
    assert k3 < 0.1 * closed  # second order in the (small) per-element KL


def _train(policy, beta: float, estimator: str, steps: int, tmp_path) -> list[dict]:
    cfg = OnlineConfig(algorithm="grpo", num_generations=4, prompts_per_step=2, micro_batch_size=8, max_steps=steps,
                       learning_rate=3e-3, beta=beta, kl_estimator=estimator, epsilon=1e-2, report_to="none",
                       output_dir=str(tmp_path / estimator))
    flat = lambda prompts, completions: [0.0] * len(completions)  # noqa: E731  no reward: only the KL acts
    return OnlineTrainer(policy, flat, [{"prompt": "a cat"}, {"prompt": "a dog"}], cfg).train()


@pytest.mark.slow
def test_closed_form_kl_pulls_the_policy_back_to_its_reference(make_policy, tmp_path):
    """No reward, only beta * KL: 8 steps take a perturbed LoRA most of the way back (probe batch fixed)."""
    policy = make_policy("sd", lora_rank=2, guidance_scale=1.0)
    _perturb([p for n, p in policy.unet.named_parameters() if "lora_B" in n], 0.05)
    probe = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(3))
    start = float(policy.log_prob_and_kl(probe)[2].detach().mean())
    _train(policy, beta=1.0, estimator="gaussian", steps=8, tmp_path=tmp_path)
    assert float(policy.log_prob_and_kl(probe)[2].detach().mean()) < 0.5 * start


def test_k3_gradient_is_the_closed_form_gradient_over_d(make_policy):
    """E[grad k3] ~ grad KL / D on mean-reduced steps (``unialign.algos.kl``): the same direction, 1/D the
    strength -- so beta * k3 weighs against the reward like beta / D of the closed form (measured
    projection ratios 0.002-0.009, D = 256, cosine 0.75-0.99)."""
    policy = make_policy("sd", lora_rank=2, guidance_scale=1.0)
    _perturb([p for n, p in policy.unet.named_parameters() if "lora_B" in n], 0.05)
    params, d = list(policy.trainable_parameters()), 4 * 8 * 8
    for seed in (0, 1):
        traj = policy.sample(PROMPTS * 8, generator=torch.Generator().manual_seed(seed))
        logp, _, kl = policy.log_prob_and_kl(traj)
        g_closed = torch.autograd.grad(kl.mean(), params, retain_graph=True)
        k3 = kl_estimate(logp, policy.reference().log_prob(traj), "k3")
        g_k3 = torch.autograd.grad(k3.mean(), params)
        dot = sum(float((a * b).sum()) for a, b in zip(g_k3, g_closed))
        norm_closed = sum(float((b * b).sum()) for b in g_closed)
        norm_k3 = sum(float((a * a).sum()) for a in g_k3)
        assert 0.2 / d < dot / norm_closed < 5.0 / d
        assert dot / (norm_closed * norm_k3) ** 0.5 > 0.5


def test_closed_form_kl_needs_a_gaussian_policy(tmp_path):
    from tests.conftest import make_tiny_lm
    from unialign.text.policy import CausalLMPolicy

    policy = CausalLMPolicy(*make_tiny_lm(), max_new_tokens=4)
    cfg = OnlineConfig(algorithm="grpo", beta=0.1, kl_estimator="gaussian", report_to="none", output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="gaussian.*k1, k2 or k3"):
        OnlineTrainer(policy, lambda prompts, completions: [0.0] * len(completions), [{"prompt": "1+1="}], cfg)
    with pytest.raises(ValueError, match="kl_estimator: 'k9' is not one of"):
        OnlineTrainer(policy, lambda prompts, completions: [0.0] * len(completions), [{"prompt": "1+1="}],
                      OnlineConfig(algorithm="grpo", beta=0.1, kl_estimator="k9", report_to="none",
                                   output_dir=str(tmp_path)))
