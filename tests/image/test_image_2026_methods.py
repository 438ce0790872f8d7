"""DGPO, GRPO-Guard and Flow-DPPO as registered policy losses on the contract: the policy terms they read (a flow
policy's recorded step means, the forward process's reference / old log-probs and the trust term to the old
weights), each registered loss against an element-wise restatement of its reference code, the trainer's whole-group
micro-batches and per-step ratio diagnostics, and the unchanged OnlineTrainer training each preset on tiny
random-weight SD3 policies built in code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.image.test_flow_policy import PROMPTS, make_flow_policy  # noqa: F401 - the fixture
from unialign import algos
from unialign.registry import get_algorithm
from unialign.trainers import OnlineConfig, OnlineTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def brightness(prompts, completions, **_):
    return [float(np.asarray(im).mean() / 255) for im in completions]


# ----------------------------------------------------------------------------- the registered losses, element-wise
def _gauss(B=3, T=4, D=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(B, T, D, generator=g, dtype=torch.float64) * 0.1
    old = mean + 0.01 * torch.randn(B, T, D, generator=g, dtype=torch.float64)
    std = 0.05 + torch.rand(B, T, generator=g, dtype=torch.float64) * 0.2
    dt = -(0.05 + torch.rand(B, T, generator=g, dtype=torch.float64) * 0.2)
    logp = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.01
    old_logp = logp + 0.003 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, -1] = 0.0
    return mean, old, std, dt, logp, old_logp, adv, mask


def test_grpo_guard_loss_is_clipped_ratio_norm_over_dt():
    mean, old, std, dt, logp, old_logp, adv, mask = _gauss()
    mean.requires_grad_(True)
    logp.requires_grad_(True)
    spec = get_algorithm("grpo_guard", epsilon=0.002)
    loss, m = algos.get_policy_loss("grpo_guard")(logp, old_logp, adv, mask, spec, step_gauss=(mean, old, std, dt))
    B, T = mask.shape
    for b in range(B):
        for t in range(T):
            if mask[b, t] == 0:
                assert float(loss[b, t]) == 0.0
                continue
            gap = sum((float(mean[b, t, d]) - float(old[b, t, d])) ** 2 for d in range(mean.shape[-1])) / mean.shape[-1]
            s = float(std[b, t])
            rho = math.exp(s * (float(logp[b, t]) - float(old_logp[b, t]) + gap / (2 * s * s)))
            a = float(adv[b])
            want = max(-a * rho, -a * min(max(rho, 1 - 0.002), 1 + 0.002)) / (-float(dt[b, t]))
            assert math.isclose(float(loss[b, t]), want, rel_tol=1e-9, abs_tol=1e-15)
    (loss.sum()).backward()
    assert mean.grad.abs().sum() > 0 and logp.grad.abs().sum() > 0  # the mean gap is trained too (verl-omni)
    assert "clipped_B_T" in m and m["clipped_B_T"].shape == (B, T)


def test_flow_dppo_drops_far_steps_moving_with_their_advantage():
    mean, old, std, dt, logp, old_logp, adv, mask = _gauss(seed=1)
    logp.requires_grad_(True)
    fn = algos.get_policy_loss("flow_dppo")
    B, T = mask.shape
    kl = [[sum((float(mean[b, t, d]) - float(old[b, t, d])) ** 2 for d in range(5)) / 5 / (2 * float(std[b, t]) ** 2)
           for t in range(T)] for b in range(B)]
    delta = sorted(v for row in kl for v in row)[len(kl) * T // 2]  # the median KL: some steps above it
    loss, m = fn(logp, old_logp, adv, mask, get_algorithm("flow_dppo", kl_mask_threshold=delta),
                 step_gauss=(mean, old, std, dt))
    dropped = 0
    for b in range(B):
        for t in range(T):
            r = math.exp(float(logp[b, t]) - float(old_logp[b, t]))
            a = float(adv[b])
            drop = kl[b][t] >= delta and ((r > 1 and a > 0) or (r < 1 and a < 0))
            dropped += bool(drop and mask[b, t] > 0)
            want = 0.0 if (drop or mask[b, t] == 0) else -a * r
            assert math.isclose(float(loss[b, t]), want, rel_tol=1e-9, abs_tol=1e-15)
    assert dropped > 0 and float(m["dropped_B_T"].sum()) == dropped
    loss.sum().backward()
    assert torch.equal(logp.grad == 0, (m["dropped_B_T"] > 0) | (mask == 0))  # no gradient through dropped steps
    # delta = inf keeps every step: the unclipped -A rho
    loss_inf, _ = fn(logp, old_logp, adv, mask, get_algorithm("flow_dppo", kl_mask_threshold=1e30),
                     step_gauss=(mean, old, std, dt))
    torch.testing.assert_close(loss_inf, -adv[:, None] * torch.exp(logp - old_logp) * mask)


def test_dgpo_loss_reads_errors_as_negative_matching_log_probs():
    g = torch.Generator().manual_seed(3)
    B, K, G = 6, 2, 3
    logp = -torch.rand(B, K, generator=g, dtype=torch.float64).requires_grad_(True)
    ref, ema = -torch.rand(B, K, generator=g, dtype=torch.float64), logp.detach() + 1e-3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    spec = get_algorithm("dgpo")
    loss, m = algos.get_policy_loss("dgpo")(logp, logp.detach(), adv[:, None].expand(B, K), torch.ones(B, K), spec,
                                            dgpo=(ref, ema), group_size=G)
    for k in range(K):
        for grp in range(B // G):
            idx = range(grp * G, grp * G + G)
            s = spec.dgpo_beta / G * sum(float(adv[i]) * (-float(logp[i, k]) + float(ref[i, k])) for i in idx)
            w = 1 / (1 + math.exp(-s))
            for i in idx:
                rho = math.exp(float(logp[i, k]) - float(ema[i, k]))  # exp(err_old - err)
                assert math.isclose(float(loss[i, k]), w * float(adv[i]) * -float(logp[i, k]), rel_tol=1e-9)
                held = (adv[i] > 0 and rho > 1 + spec.epsilon) or (adv[i] <= 0 and rho < 1 - spec.epsilon)
                assert bool(m["clipped_B_T"][i, k]) == held
    assert algos.get_policy_loss("dgpo").whole_groups and algos.get_policy_loss("dgpo").inputs == ("dgpo",)


def test_step_ratio_diagnostics_per_step():
    logp = torch.tensor([[0.0, 0.1, 0.0], [0.0, -0.1, 0.2]])
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    total: dict = {}
    algos.add_step_sums(total, algos.step_ratio_sums(logp, old, mask, {"clipped": torch.tensor([[0, 1, 1], [0, 0, 1.]])}),
                        {})
    algos.add_step_sums(total, algos.step_ratio_sums(logp, old, mask), {})  # no indicator this time: counted as 0
    stats = algos.step_ratio_stats(total)
    r = [math.exp(0.1), math.exp(-0.1)]
    assert math.isclose(stats["steps/ratio_mean/0"], 1.0) and stats["steps/ratio_std/0"] == 0.0
    assert math.isclose(stats["steps/ratio_mean/1"], sum(r) / 2, rel_tol=1e-6)
    assert math.isclose(stats["steps/ratio_std/1"], abs(r[0] - r[1]) / 2, rel_tol=1e-5)
    assert math.isclose(stats["steps/clipped_frac/1"], 1 / 4) and math.isclose(stats["steps/clipped_frac/2"], 1 / 2)
    assert algos.step_ratio_stats({}) == {}


# ----------------------------------------------------------------------------- the policy's terms
def test_flow_policy_records_step_means_and_gives_them_back(make_flow_policy):  # noqa: F811
    policy = make_flow_policy(num_steps=4, guidance_scale=1.0)
    with pytest.raises(ValueError, match="offers no loss terms \\['nft'\\]"):
        policy.prepare_terms(("nft",))
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(0))
    assert "means" not in traj.payload  # recorded only when a loss asks
    with pytest.raises(ValueError, match="lacks"):
        policy.log_prob_terms(traj, ("step_gauss",))
    policy.prepare_terms(("step_gauss",))
    traj = policy.sample(PROMPTS, generator=torch.Generator().manual_seed(0))
    logp, entropy, kl, terms = policy.log_prob_terms(traj, ("step_gauss",))
    mean, old, std, dt = terms["step_gauss"]
    live = traj.mask_B_T > 0
    assert mean.shape == old.shape == (2, 4, 4, 8, 8) and mean.requires_grad and kl is None
    torch.testing.assert_close(mean[live], old[live], atol=1e-5, rtol=1e-5)  # before an update: the sampler's means
    torch.testing.assert_close(logp, traj.old_logp_B_T, atol=1e-4, rtol=1e-4)
    sig = policy.scheduler.sigmas
    torch.testing.assert_close(dt[0], (sig[1:5] - sig[:4]).float())
    assert (std[live] > 0).all() and torch.equal(entropy, policy.log_prob_and_entropy(traj)[1])


def test_forward_terms_dgpo_and_old_mse(make_flow_policy):  # noqa: F811
    policy = make_flow_policy(num_steps=6, guidance_scale=1.0, lora_rank=2)
    policy.use_forward_process(train_timesteps=2, timestep_fraction=0.5, time_sampling="random", weighting="uniform",
                               old_decay=lambda step: 0.5, share_pairs=True)
    traj = policy.sample(["a cat"] * 2 + ["a red circle"] * 2, generator=torch.Generator().manual_seed(1))
    p = traj.payload
    assert torch.equal(p["timesteps"][0], p["timesteps"][1]) and torch.equal(p["noise"][2], p["noise"][3])
    assert not torch.equal(p["noise"][0], p["noise"][2])  # shared within a group only
    logp0, _, _, terms = policy.log_prob_terms(traj, ("dgpo", "old_mse"))
    ref_logp, old_logp = terms["dgpo"]
    torch.testing.assert_close(ref_logp, logp0.detach())  # LoRA B = 0: the reference is the policy
    torch.testing.assert_close(old_logp, logp0.detach())
    assert float(terms["old_mse"].abs().max()) == 0.0
    with torch.no_grad():
        for prm in policy.trainable_parameters():
            prm.add_(0.05 * torch.randn_like(prm))
    logp, _, _, terms = policy.log_prob_terms(traj, ("dgpo", "old_mse"))
    torch.testing.assert_close(terms["dgpo"][0], ref_logp)  # the reference did not move
    torch.testing.assert_close(terms["dgpo"][1], old_logp)  # nor the old weights (no optimizer step)
    assert float(terms["old_mse"].min()) > 0 and terms["old_mse"].requires_grad
    # the uniform weighting: logp = -mean_D (v - (eps - x0))^2, so -logp is DGPO's err
    assert (logp < 0).all()


def test_forward_terms_without_an_old_policy_are_the_current_weights_in_one_pass(make_flow_policy,  # noqa: F811
                                                                                  monkeypatch):
    """No old policy (``old_decay`` None: DGPO without its clip): the old weights are the current ones, so the old
    log-probs are the current ones, detached, and the denoiser runs once per pair for the policy (plus once for the
    reference) instead of a second time for the old weights."""
    policy = make_flow_policy(num_steps=6, guidance_scale=1.0, lora_rank=2)
    policy.use_forward_process(train_timesteps=2, timestep_fraction=0.5, time_sampling="random", weighting="uniform",
                               old_decay=None, share_pairs=True)
    assert not policy.has_old_policy
    traj = policy.sample(["a cat"] * 2 + ["a red circle"] * 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for prm in policy.trainable_parameters():
            prm.add_(0.05 * torch.randn_like(prm))  # the policy now differs from the reference
    calls = []
    denoise = policy._denoise
    monkeypatch.setattr(policy, "_denoise", lambda *a, **k: calls.append(1) or denoise(*a, **k))
    logp, _, _, terms = policy.log_prob_terms(traj, ("dgpo", "old_mse"))
    assert len(calls) == 2  # the policy and the reference; no pass for old weights
    ref_logp, old_logp = terms["dgpo"]
    assert torch.equal(old_logp, logp.detach()) and not old_logp.requires_grad
    assert not torch.allclose(ref_logp, logp.detach())
    assert float(terms["old_mse"].abs().max()) == 0.0


# ----------------------------------------------------------------------------- the trainer
@pytest.mark.parametrize("algorithm", ["grpo_guard", "flow_dppo"])
def test_sde_presets_train_with_per_step_diagnostics(make_flow_policy, tmp_path, algorithm):  # noqa: F811
    policy = make_flow_policy(num_steps=4, guidance_scale=1.0, lora_rank=2)
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    cfg = OnlineConfig(algorithm=algorithm, num_generations=2, prompts_per_step=2, micro_batch_size=2, max_steps=2,
                       num_iterations=2, learning_rate=1e-2, report_to="none", output_dir=str(tmp_path))
    history = OnlineTrainer(policy, brightness, [{"prompt": p} for p in PROMPTS], cfg).train()
    assert all(np.isfinite(h["reward/mean"]) for h in history)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.trainable_parameters()))
    last = history[-1]
    steps = sorted(k for k in last if k.startswith("steps/ratio_mean/"))
    assert len(steps) == 4  # without a window the SDE trains every step
    assert any(abs(last[k] - 1.0) > 0 for k in steps)  # the second epoch's ratios moved off 1
    indicator = "clipped" if algorithm == "grpo_guard" else "dropped"
    assert all(0.0 <= last[k.replace("ratio_mean", f"{indicator}_frac")] <= 1.0 for k in steps)


def test_dgpo_trains_on_whole_groups(make_flow_policy, tmp_path, monkeypatch):  # noqa: F811
    policy = make_flow_policy(num_steps=6, guidance_scale=1.0, lora_rank=2)
    policy.use_forward_process(train_timesteps=2, timestep_fraction=0.5, time_sampling="random", weighting="uniform",
                               old_decay=lambda step: min(0.001 * step, 0.3), share_pairs=True)
    seen = []
    loss_fn = algos.get_policy_loss("dgpo")

    def spy(logp, old_logp, advantages, mask, spec, dgpo, group_size):
        seen.append((len(logp), group_size))
        return loss_fn(logp, old_logp, advantages, mask, spec, dgpo=dgpo, group_size=group_size)

    spy.inputs, spy.whole_groups = loss_fn.inputs, True
    monkeypatch.setitem(algos.policy_loss.POLICY_LOSSES, "dgpo", spy)
    rows = [{"prompt": p} for p in PROMPTS]
    with pytest.raises(ValueError, match="whole groups of num_generations=2"):
        OnlineTrainer(policy, brightness, rows, OnlineConfig(algorithm="dgpo", num_generations=2, prompts_per_step=2,
                                                             micro_batch_size=3, report_to="none",
                                                             output_dir=str(tmp_path / "a")))
    cfg = OnlineConfig(algorithm="dgpo", num_generations=2, prompts_per_step=2, micro_batch_size=2, max_steps=2,
                       learning_rate=1e-2, report_to="none", output_dir=str(tmp_path / "b"))
    history = OnlineTrainer(policy, brightness, rows, cfg).train()
    assert seen and all(n == 2 and g == 2 for n, g in seen)
    assert "clip_frac" in history[-1] and "kl" in history[-1]
    assert not any(k.startswith("steps/") for k in history[-1])  # forward-process pairs: no per-step statistics


def test_awm_trust_term_reads_the_old_weights(make_flow_policy, tmp_path):  # noqa: F811
    policy = make_flow_policy(num_steps=6, guidance_scale=1.0, lora_rank=2)
    policy.use_forward_process(train_timesteps=3, timestep_fraction=0.9, old_decay=lambda step: 0.9)
    cfg = OnlineConfig(algorithm="awm", num_generations=2, prompts_per_step=2, micro_batch_size=4, max_steps=3,
                       learning_rate=1e-2, report_to="none", output_dir=str(tmp_path))
    assert get_algorithm("awm").ema_beta == 1.0
    history = OnlineTrainer(policy, brightness, [{"prompt": p} for p in PROMPTS], cfg).train()
    assert history[0]["old_mse"] == 0.0 and history[-1]["old_mse"] > 0  # the average lags the trained weights
    sde = make_flow_policy(num_steps=4, guidance_scale=1.0)
    with pytest.raises(ValueError, match="ema_beta=1.0.*offers no loss terms \\['old_mse'\\]"):
        OnlineTrainer(sde, brightness, [{"prompt": "a cat"}],
                      OnlineConfig(algorithm="flow_grpo", ema_beta=1.0, report_to="none", output_dir=str(tmp_path / "x")))


def test_dgpo_sampling_chunks_hold_whole_groups():
    from unialign.recipes.image import ImageRLConfig, forward_process_kwargs

    kw = dict(algorithm="dgpo", num_steps=10, num_generations=4, report_to="none")
    assert forward_process_kwargs(ImageRLConfig(**kw, sample_batch_size=8))["share_pairs"]
    with pytest.raises(ValueError, match="sample_batch_size=6: dgpo shares each group's pairs"):
        forward_process_kwargs(ImageRLConfig(**kw, sample_batch_size=6))
