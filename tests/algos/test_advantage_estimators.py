"""Advantage estimators as registered functions; REINFORCE++ pinned to numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_tiny_lm
from unialign import algos
from unialign.registry import ALGORITHMS, get_algorithm


def test_every_preset_names_a_registered_estimator():
    for name, spec in ALGORITHMS.items():
        assert spec.advantage in algos.ADVANTAGE_ESTIMATORS, name
    assert algos.get_estimator("gae").needs_critic and algos.get_estimator("gae").needs_step_rewards
    assert algos.get_estimator("reinforce_pp").needs_step_rewards and not algos.get_estimator("reinforce_pp").needs_critic
    assert algos.get_estimator("group").uses_groups and not algos.get_estimator("reinforce_pp").uses_groups
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        algos.get_estimator("nope")
    with pytest.raises(ValueError, match="already registered"):
        algos.register_advantage("group")(lambda inputs, spec: None)


def test_discounted_returns_by_hand():
    r = torch.tensor([[1.0, 2.0, 3.0, 9.0], [0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    g1 = algos.discounted_returns(r, m, 1.0)
    assert g1.tolist() == [[6.0, 5.0, 3.0, 0.0], [0.5, 0.0, 0.0, 0.0]]  # the masked 9 is ignored
    g = algos.discounted_returns(r, m, 0.5)
    assert g[0].tolist() == pytest.approx([1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3, 3.0, 0.0])


def test_global_whiten_equals_whole_batch_whitening_across_simulated_processes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    m = (torch.rand(6, 5, generator=g) > 0.3).double()
    whole = algos.global_whiten(x, m)
    assert torch.allclose(whole, algos.whiten(x, m))
    halves = [(x[:3], m[:3]), (x[3:], m[3:])]
    stats = [torch.stack([(a * b).sum(), (a * a * b).sum(), b.sum()]) for a, b in halves]
    both = stats[0] + stats[1]  # what an all-reduce over two processes returns to each
    parts = [algos.global_whiten(a, b, all_sum=lambda t, both=both: both) for a, b in halves]
    assert torch.allclose(torch.cat(parts), whole)


def test_reinforce_pp_advantages_by_hand():
    """Scores [1, 0]; k1 KL per token; beta 0.5; gamma 1. r_t = -0.5 KL_t, plus the score at the last
    token; G_t = sum of r from t on; A = (G - mean) / std (unbiased) over the 5 real tokens."""
    scores = torch.tensor([1.0, 0.0], dtype=torch.float64)
    kl = torch.tensor([[0.1, 0.2, 0.7], [0.3, 0.1, 0.2]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    step = algos.kl_shaped_rewards(scores, kl, mask, 0.5)
    out = algos.get_estimator("reinforce_pp").fn(algos.AdvantageInputs(
        rewards_B=scores, prompts=["a", "b"], group_size=1, rows=slice(0, 2), mask_B_T=mask, step_rewards_B_T=step),
        get_algorithm("reinforce_pp"))
    G = [-0.05 + (-0.1 + 1.0), -0.1 + 1.0, -0.15 - 0.05 - 0.1, -0.05 - 0.1, -0.1]
    mean = sum(G) / 5
    std = math.sqrt(sum((g - mean) ** 2 for g in G) / 4)
    want = [(g - mean) / math.sqrt(std**2 + 1e-8) for g in G]
    got = out.advantages_B_T
    assert [got[0, 0].item(), got[0, 1].item(), got[1, 0].item(), got[1, 1].item(), got[1, 2].item()] == \
        pytest.approx(want, rel=1e-9)
    assert got[0, 2] == 0 and out.returns_B_T is None


@pytest.mark.slow
def test_trainer_refuses_a_critic_estimator_without_a_critic_and_mismatched_knobs(tmp_path):
    from unialign.text.policy import CausalLMPolicy
    from unialign.trainers import OnlineConfig, OnlineTrainer

    model, tok = make_tiny_lm()
    rows = [{"prompt": "1+1?"}]
    common = dict(num_generations=2, prompts_per_step=1, report_to="none", output_dir=str(tmp_path))
    reward = lambda prompts, completions: [0.0] * len(completions)  # noqa: E731
    with pytest.raises(ValueError, match="needs a critic"):
        OnlineTrainer(CausalLMPolicy(model, tok), reward, rows, OnlineConfig(algorithm="ppo", **common))
    with pytest.raises(ValueError, match="value_coef"):
        OnlineTrainer(CausalLMPolicy(model, tok), reward, rows, OnlineConfig(algorithm="grpo", value_coef=0.1, **common))
    with pytest.raises(ValueError, match="kl_in_reward"):
        bad = get_algorithm("grpo", kl_in_reward=True, beta=0.1)
        cfg = OnlineConfig(algorithm="grpo", beta=0.1, **common)
        cfg.algo_spec = lambda: bad
        OnlineTrainer(CausalLMPolicy(model, tok), reward, rows, cfg)


def test_a_registered_policy_loss_is_what_the_trainer_calls(tmp_path, monkeypatch):
    """Adding a policy loss is one registered function; --policy_loss picks it, the trainer looks it up."""
    from unialign.algos import policy_loss as pl
    from unialign.text.policy import CausalLMPolicy
    from unialign.trainers import OnlineConfig, OnlineTrainer

    calls = []

    def plain_pg(logp, old_logp, advantages, mask, spec):  # REINFORCE's -A * log pi, no ratio, no clip
        calls.append(spec.name)
        adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
        return -adv * logp * mask, {}

    monkeypatch.setitem(pl.POLICY_LOSSES, "plain_pg", plain_pg)
    assert algos.get_policy_loss("plain_pg") is plain_pg and "clipped" in algos.POLICY_LOSSES
    model, tok = make_tiny_lm()
    cfg = OnlineConfig(algorithm="rloo", policy_loss="plain_pg", num_generations=2, prompts_per_step=2, max_steps=1,
                       report_to="none", output_dir=str(tmp_path))
    trainer = OnlineTrainer(CausalLMPolicy(model, tok, max_new_tokens=4), lambda prompts, completions: [
        float(len(c)) for c in completions], [{"prompt": "1+1?"}, {"prompt": "2+2?"}], cfg)
    trainer.train()
    assert calls == ["rloo"]
    with pytest.raises(ValueError, match="already registered"):
        algos.register_policy_loss("clipped")(plain_pg)
    from unialign.algos.aggregate import register_aggregation

    with pytest.raises(ValueError, match="already registered"):
        register_aggregation("token_mean", lambda m, n: m.sum())(lambda x, m, n: x.sum())


def test_flow_grpo_preset_is_flow_grpos_published_recipe():
    """Flow-GRPO (yifan123/flow_grpo, config/grpo.py + train_sd3.py): clip 1e-4, advantages clipped to +-5, KL 0.04
    in the loss with Flow-GRPO's closed-form step KL (gaussian_g2), per-prompt group means divided by the std of all rewards
    (``global_std``; here the unbiased std, Flow-GRPO's np.std is the population one: a factor sqrt(B/(B-1)))."""
    import numpy as np

    spec = get_algorithm("flow_grpo")
    assert (spec.epsilon, spec.epsilon_high, spec.advantage_clip, spec.beta, spec.kl_estimator, spec.kl_in_reward) == \
        (1e-4, None, 5.0, 0.04, "gaussian_g2", False)
    rng = np.random.default_rng(0)
    r = rng.normal(size=(3, 4))  # 3 prompts x a group of 4
    r[2] = 0.7  # a group with one reward: advantage 0
    want = (r - r.mean(axis=1, keepdims=True)) / (r.std(ddof=1) + 1e-4)
    out = algos.get_estimator(spec.advantage).fn(algos.AdvantageInputs(
        rewards_B=torch.tensor(r.reshape(-1)), prompts=[p for p in "abc" for _ in range(4)], group_size=4,
        rows=slice(0, 12), mask_B_T=torch.ones(12, 2, dtype=torch.float64)), spec)
    assert out.advantages_B_T[:, 0].tolist() == pytest.approx(want.reshape(-1).tolist(), rel=1e-9)
    assert (out.advantages_B_T[:, 0] == out.advantages_B_T[:, 1]).all()  # the same advantage at every step
