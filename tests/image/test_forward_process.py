"""Forward-process trajectories (``ForwardKernel``: AWM, DiffusionNFT) on tiny random-weight SD3 and SD1 policies
built in code: collection with a deterministic solver, the pairs, ratio 1, the forward process against a hand
restatement for both parametrisations, the old policy, and the unchanged OnlineTrainer training both methods."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.image.test_flow_policy import PROMPTS, make_flow_policy  # noqa: F401 - the fixture
from unialign.trainers import OnlineConfig, OnlineTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def brightness(prompts, completions, **_):
    return [float(np.asarray(im).mean() / 255) for im in completions]


@pytest.fixture
def flow(make_flow_policy):  # noqa: F811
    def factory(**kw):
        policy = make_flow_policy(num_steps=6, guidance_scale=1.0, **kw)
        policy.use_forward_process(train_timesteps=3, timestep_fraction=1.0)
        return policy
    return factory


def test_collection_is_the_deterministic_euler_solver_and_records_pairs(flow):
    policy = flow()
    traj = policy.sample(PROMPTS * 2, generator=torch.Generator().manual_seed(0))
    p = traj.payload
    assert p["x0"].shape == (4, 4, 8, 8) and p["noise"].shape == (4, 3, 4, 8, 8) and p["timesteps"].shape == (4, 3)
    assert traj.mask_B_T.shape == (4, 3) and traj.old_logp_B_T.shape == (4, 3)
    # the x0 is the stock Euler ODE: x + (sigma' - sigma) v from the same x_T
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, 8, 8, generator=g)
    cond = policy.encode_prompts(PROMPTS * 2)
    sig = policy.scheduler.sigmas
    with torch.no_grad():
        for i, t in enumerate(policy.scheduler.timesteps):
            x = x + (sig[i + 1] - sig[i]) * policy._denoise(policy.transformer, x, t.expand(4), cond, False)
    torch.testing.assert_close(p["x0"], x, atol=1e-5, rtol=0)
    # stratified over steps 1 .. int(N f) - 1 = 1 .. 5: AWM's strata of linspace(1, 6, 4) = [1, 2, 4, 6) as ints
    index = {float(t): i for i, t in enumerate(policy.scheduler.timesteps)}
    steps = torch.tensor([[index[float(t)] for t in row] for row in p["timesteps"]])
    assert (steps[:, 0] == 1).all() and ((steps[:, 1] >= 2) & (steps[:, 1] < 4)).all()
    assert ((steps[:, 2] >= 4) & (steps[:, 2] < 6)).all()


def test_ratio_one_and_the_forward_process_by_hand(flow):
    policy = flow()
    traj = policy.sample(PROMPTS * 2, generator=torch.Generator().manual_seed(1))
    logp = policy.log_prob(traj)
    torch.testing.assert_close(logp, traj.old_logp_B_T, atol=1e-6, rtol=0)
    assert logp.requires_grad
    # one pair by hand: x_t = (1 - s) x0 + s eps, target eps - x0, AWM's ghuber(0.25) weighting at t = s
    p, b, k = traj.payload, 2, 1
    s = float(p["timesteps"][b, k]) / 1000
    x_t = (1 - s) * p["x0"][b:b + 1] + s * p["noise"][b, k][None]
    cond = {key: p[key][b:b + 1] for key in policy.cond_keys}
    with torch.no_grad():
        v = policy._denoise(policy.transformer, x_t, p["timesteps"][b, k].view(1), cond, False).double()
    m = float(((v - (p["noise"][b, k] - p["x0"][b]).double()) ** 2).mean())
    want = -((m + 1e-10) ** 0.25 - 1e-10**0.25) * s / 0.25
    assert abs(float(logp[b, k]) - want) < 1e-5 * abs(want) + 1e-7


def test_unet_forward_process_and_x0_estimate(make_policy):
    policy = make_policy(guidance_scale=1.0, num_steps=4)
    policy.use_forward_process(train_timesteps=2, timestep_fraction=1.0, sampler="ddim")
    traj = policy.sample(["a cat", "a dog"], generator=torch.Generator().manual_seed(0))
    assert traj.payload["x0"].shape[0] == 2 and traj.old_logp_B_T.shape == (2, 2)
    torch.testing.assert_close(policy.log_prob(traj), traj.old_logp_B_T, atol=1e-6, rtol=0)
    x0, eps = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    t = torch.tensor([10, 400, 900])
    fp = policy._forward_process(x0, eps, t)
    acp = policy.scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(fp["x_t"], acp.sqrt() * x0 + (1 - acp).sqrt() * eps)
    torch.testing.assert_close(fp["target"], eps)
    torch.testing.assert_close(policy._x0_from(eps, fp), x0, atol=1e-4, rtol=1e-4)  # the true eps gives x0 back
    dpm = make_policy(guidance_scale=1.0, num_steps=4)
    dpm.use_forward_process(train_timesteps=2, timestep_fraction=1.0, sampler="dpmpp")
    assert torch.isfinite(dpm.sample(["a cat"], generator=torch.Generator().manual_seed(0)).payload["x0"]).all()
    with pytest.raises(ValueError, match="'euler': a family on the 'ddim' step kernel collects with 'ddim' or 'dpmpp'"):
        bad = make_policy(num_steps=4)
        bad.use_forward_process(train_timesteps=2, timestep_fraction=1.0, sampler="euler")
        bad.sample(["a cat"])


def test_the_old_policy_is_a_moving_average_swapped_in_and_out(flow):
    policy = flow()
    policy.use_forward_process(train_timesteps=3, timestep_fraction=1.0, old_decay=lambda step: 0.25, sample_old=True)
    params = list(policy.trainable_parameters())
    start = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    policy.after_optimizer_step(1)  # old = 0.25 start + 0.75 (start + 1)
    with policy._old_weights():
        for p, s in zip(params, start):
            torch.testing.assert_close(p, s + 0.75)
    for p, s in zip(params, start):
        torch.testing.assert_close(p, s + 1.0)  # restored
    state = policy.state_tensors()
    other = flow()
    other.use_forward_process(train_timesteps=3, timestep_fraction=1.0, old_decay=lambda step: 0.25)
    other.load_state_tensors(state)
    assert all(torch.equal(a, b) for a, b in zip(other._old_state, policy._old_state))


def test_nft_terms_and_gradient_are_unaffected_by_the_old_forward(flow):
    policy = flow()
    policy.use_forward_process(train_timesteps=3, timestep_fraction=1.0, old_decay=lambda step: 0.5)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.01 * torch.randn_like(p))  # the trained weights move away from the old ones
    traj = policy.sample(PROMPTS * 2, generator=torch.Generator().manual_seed(2), record_logp=False)
    logp, entropy, kl, terms = policy.log_prob_terms(traj, ("nft",))
    old_err, delta = terms["nft"]
    assert kl is None and old_err.shape == (4, 3, 4, 8, 8) and delta.requires_grad and (entropy == 0).all()
    assert float(delta.abs().max()) > 0
    logp.sum().backward()
    with_old = [p.grad.clone() for p in policy.trainable_parameters()]
    policy.model.zero_grad()
    policy.log_prob(traj).sum().backward()
    for a, p in zip(with_old, policy.trainable_parameters()):
        torch.testing.assert_close(a, p.grad)  # the old weights' forward left the graph alone


@pytest.mark.parametrize("algorithm", ["awm", "nft"])
def test_the_online_trainer_trains_both_methods(flow, tmp_path, algorithm):
    policy = flow(lora_rank=2)
    if algorithm == "nft":
        policy.use_forward_process(train_timesteps=3, timestep_fraction=1.0, time_sampling="random",
                                   old_decay=lambda step: min(0.001 * step, 0.5), sample_old=True)
    before = {n: p.detach().clone() for n, p in policy.transformer.named_parameters() if p.requires_grad}
    cfg = OnlineConfig(algorithm=algorithm, num_generations=2, prompts_per_step=2, micro_batch_size=4, max_steps=2,
                       learning_rate=1e-2, report_to="none", output_dir=str(tmp_path))
    history = OnlineTrainer(policy, brightness, [{"prompt": p} for p in PROMPTS], cfg).train()
    assert len(history) == 2 and all(np.isfinite(h["reward/mean"]) for h in history)
    assert any(not torch.equal(p, before[n]) for n, p in policy.transformer.named_parameters() if p.requires_grad)
    assert "kl" in history[-1]  # the prediction-MSE KL to the reference (adapters off)


def test_forward_algorithms_are_refused_where_they_do_not_apply(tmp_path, make_policy):
    from tests.conftest import make_tiny_lm
    from unialign.text.policy import CausalLMPolicy

    cfg = OnlineConfig(algorithm="awm", report_to="none", output_dir=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="'forward' log-prob estimator, but this CausalLMPolicy provides 'sampler'"):
        OnlineTrainer(CausalLMPolicy(*make_tiny_lm(), max_new_tokens=4), lambda p, c: [0.0] * len(c),
                      [{"prompt": "1+1="}], cfg)
    ddim = make_policy()
    with pytest.raises(ValueError, match="'forward' log-prob estimator"):  # a denoiser still on its sampler's steps
        OnlineTrainer(ddim, brightness, [{"prompt": "a cat"}], OnlineConfig(algorithm="nft", report_to="none",
                                                                            output_dir=str(tmp_path / "b")))
    ddim.use_forward_process(train_timesteps=2, timestep_fraction=1.0)
    with pytest.raises(ValueError, match="offers the closed forms \\['prediction_mse'\\]"):
        OnlineTrainer(ddim, brightness, [{"prompt": "a cat"}],
                      OnlineConfig(algorithm="awm", kl_estimator="gaussian", report_to="none",
                                   output_dir=str(tmp_path / "c")))
