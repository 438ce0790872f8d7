"""The on-policy loop: ratio-1 self-check, dynamic sampling, guards, split invariance, resume, 1 vs 2 processes."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_lm
from tests.helpers import assert_close
from unialign.text.policy import CausalLMPolicy, unwrap
from unialign.trainers import OnlineConfig, OnlineTrainer, RatioCheckError
from unialign.trainers.online import curve_keys

ROWS = [{"prompt": f"{i}+{i}?", "answer": str(2 * i)} for i in range(12)]


def length_reward(prompts, completions):
    return [len(c) / 8.0 for c in completions]


def make(tmp_path, reward=length_reward, rows=ROWS, seed=0, **kw):
    model, tok = make_tiny_lm(seed=seed)
    policy = CausalLMPolicy(model, tok, max_new_tokens=8)
    cfg = dict(num_generations=4, prompts_per_step=2, micro_batch_size=4, max_steps=2, report_to="none",
               output_dir=str(tmp_path), learning_rate=1e-2, beta=0.0, seed=seed)
    cfg.update(kw)
    return OnlineTrainer(policy, reward, rows, OnlineConfig(**cfg))


def params(trainer):
    return {k: v.detach().clone() for k, v in unwrap(trainer.policy.model).named_parameters()}


def capture_gradients(trainer) -> dict:
    """Replace the optimizer step by a recorder of the accumulated gradients (Adam would amplify
    float32 round-off in near-zero gradients, so compare what reaches the optimizer)."""
    grads = {}
    named = list(unwrap(trainer.policy.model).named_parameters())
    trainer.optimizer.step = lambda *a, **k: grads.update({n: p.grad.detach().clone() for n, p in named})
    return grads


def test_ratio_check_fails_loudly_when_sampling_and_training_disagree(tmp_path):
    trainer = make(tmp_path)
    sample = trainer.policy.sample

    def skewed_sample(prompts, generator=None, record_logp=True):
        traj = sample(prompts)
        traj.old_logp_B_T = traj.old_logp_B_T - 0.1 * traj.mask_B_T
        return traj

    trainer.policy.sample = skewed_sample
    with pytest.raises(RatioCheckError, match="differ from the sampling-time"):
        trainer.train()


def test_single_step_batches_skip_the_scoring_forward_and_update_identically(tmp_path):
    """After the first step's ratio check, one-optimizer-step batches take old log-probs from the
    update's own forward (no scoring forward at sampling); the gradients equal the recorded path's."""
    def run(name: str, force_record: bool):
        trainer = make(tmp_path / name, max_steps=3)
        sample, flags, steps = trainer.policy.sample, [], []

        def spy(prompts, generator=None, record_logp=True):
            flags.append(record_logp)
            return sample(prompts, generator, record_logp=force_record or record_logp)

        trainer.policy.sample = spy
        grads = capture_gradients(trainer)
        record = trainer.optimizer.step
        trainer.optimizer.step = lambda *a, **k: (record(), steps.append(dict(grads)))
        trainer.train()
        return flags, steps

    runs = {"skip": run("skip", False), "record": run("record", True)}
    flags, steps = runs["skip"]
    assert flags == [True, False, False]  # the first batch is recorded for the ratio-1 check
    assert runs["record"][0] == [True, False, False]
    for skip, rec in zip(steps, runs["record"][1]):
        for k in rec:
            assert_close(skip[k], rec[k])


def test_dynamic_sampling_keeps_only_groups_with_signal(tmp_path):
    def reward(prompts, completions):  # prompts "0+0?".."5+5?" always score 1: zero-variance groups
        return [1.0 if int(p.split("+")[0]) < 6 else len(c) / 8.0 for p, c in zip(prompts, completions)]

    trainer = make(tmp_path, reward=reward, algorithm="dapo", prompts_per_step=4, max_generation_rounds=4)
    traj, stats = trainer.collect()
    assert traj is not None
    r = traj.rewards_B.reshape(-1, 4)
    assert (r.max(1).values > r.min(1).values).all()
    assert stats["frac_reward_zero_std"] > 0 and stats["generation_rounds"] >= 1
    # without dynamic sampling the zero-variance groups stay (and get advantage 0)
    trainer = make(tmp_path, reward=reward, algorithm="grpo", prompts_per_step=4)
    traj, _ = trainer.collect()
    r = traj.rewards_B.reshape(-1, 4)
    zero = r.max(1).values == r.min(1).values
    assert zero.any() and (traj.advantages_B_T.reshape(-1, 4, traj.mask_B_T.shape[1])[zero] == 0).all()


def test_nonfinite_rewards_are_counted_and_get_zero_advantage(tmp_path):
    def reward(prompts, completions):
        return [None if i % 4 == 0 else len(c) / 8.0 for i, c in enumerate(completions)]

    trainer = make(tmp_path, reward=reward)
    traj, _ = trainer.collect()
    assert trainer.counters["nonfinite_rewards"] == 2
    assert (traj.advantages_B_T[::4] == 0).all() and torch.isfinite(traj.advantages_B_T).all()


def test_nonfinite_loss_never_reaches_the_weights(tmp_path):
    trainer = make(tmp_path)
    traj, _ = trainer.collect()
    log_prob = trainer.policy.log_prob_and_entropy
    trainer.policy.log_prob_and_entropy = lambda t: tuple(x * math.nan for x in log_prob(t))
    trainer.ratio_checked = True
    before = params(trainer)
    trainer.update(traj)
    assert trainer.counters["skipped_steps"] == 1
    for k, v in params(trainer).items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_update_is_independent_of_micro_batch_split(tmp_path, loss_type):
    results = []
    for mb in (1, 3, 8):
        trainer = make(tmp_path, loss_type=loss_type, micro_batch_size=mb, max_completion_length=8)
        torch.manual_seed(7)
        traj = trainer.policy.sample(["1+1?"] * 4 + ["22+3?"] * 4)
        traj.advantages_B_T = torch.linspace(-1, 1, 8).unsqueeze(-1).expand_as(traj.mask_B_T).contiguous()
        grads = capture_gradients(trainer)
        trainer.update(traj)
        results.append(grads)
    for other in results[1:]:
        for k in results[0]:
            assert_close(other[k], results[0][k], msg=k)


@pytest.mark.slow
def test_resume_matches_an_uninterrupted_run(tmp_path):
    full = make(tmp_path / "full", max_steps=4)
    full.train()
    part = make(tmp_path / "part", max_steps=4, save_steps=2)
    part.cfg.max_steps = 2
    part.train()
    assert (tmp_path / "part" / "checkpoint-2" / "trainer_state.json").exists()
    resumed = make(tmp_path / "part", max_steps=4, resume_from_checkpoint="latest")
    resumed.train()
    assert resumed.step == 4
    a, b = params(full), params(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [h["reward/mean"] for h in full.history] == [h["reward/mean"] for h in resumed.history]


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    trainer = make(tmp_path, max_steps=3, save_steps=1, save_total_limit=2)
    trainer.train()
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("checkpoint", ".tmp")))
    assert names == ["checkpoint-2", "checkpoint-3"]
    assert (tmp_path / "reward_curve.png").stat().st_size > 0


def test_bad_prompt_rows_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"prompts\[1\]: missing the 'prompt' field"):
        make(tmp_path, rows=[{"prompt": "a"}, {"question": "b"}])


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_update(tmp_path):
    root = Path(__file__).resolve().parents[2]
    # ACCELERATE_USE_CPU: without it accelerate runs each torchrun rank as its own 1-process job on a CPU machine
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    loss_types = "token_mean,seq_mean_token_mean,seq_mean_token_sum_norm"
    outs = []
    for n in (1, 2):
        out = tmp_path / f"p{n}.pt"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
               str(29611 + n), "-m", "tests.trainers.dist_update", str(out), loss_types]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(torch.load(out))
    for loss_type in loss_types.split(","):
        for k in outs[0][loss_type]:
            assert_close(outs[1][loss_type][k], outs[0][loss_type][k], msg=f"{loss_type}: {k}")


def test_ppo_trains_a_value_head_with_kl_in_the_reward(tmp_path):
    model, tok = make_tiny_lm()
    policy = CausalLMPolicy(model, tok, max_new_tokens=8, value_head=True)
    cfg = OnlineConfig(algorithm="ppo", num_generations=2, prompts_per_step=4, micro_batch_size=4, max_steps=2,
                       report_to="none", output_dir=str(tmp_path), learning_rate=1e-2, kl_target=0.01)
    trainer = OnlineTrainer(policy, length_reward, ROWS, cfg)
    head = policy.value_head.weight.detach().clone()
    history = trainer.train()
    assert not torch.equal(head, policy.value_head.weight.detach())  # the critic learned
    assert {"kl_seq", "kl_coef", "value_clip_frac", "value_loss", "explained_variance"} <= set(history[-1])
    assert "frac_reward_zero_std" not in curve_keys(trainer.spec, history)
    assert history[-1]["kl_coef"] != 0.05  # the adaptive controller moved the coefficient
    policy.save(str(tmp_path / "final"))
    assert (tmp_path / "final" / "value_head.safetensors").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))  # stock load, no unexpected keys needed


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["separate", "reward_model"])
def test_ppo_with_a_separate_critic(tmp_path, critic):
    """value_head='separate' (a copy of the backbone) or a reward-model checkpoint: the critic has its own
    weights, only the value loss trains it, and it is saved beside (not inside) the policy."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model, tok = make_tiny_lm()
    source = "separate"
    if critic == "reward_model":
        rm_dir = tmp_path / "rm"
        torch.manual_seed(7)
        config = make_tiny_lm()[0].config
        config.num_labels, config.pad_token_id = 1, tok.pad_token_id
        AutoModelForSequenceClassification.from_config(config).save_pretrained(str(rm_dir))
        source = str(rm_dir)
    policy = CausalLMPolicy(model, tok, max_new_tokens=8, value_head=source)
    assert policy.value_head is None and policy.value_model is not None
    traj = policy.sample([r["prompt"] for r in ROWS[:3]])
    _, _, values = policy.log_prob_and_values(traj)
    # independent: the critic's own forward on the concatenated prompt + completion, at the states
    # before each completion token
    payload = traj.payload
    ids = torch.cat([payload["prompt_ids"], payload["completion_ids"]], 1)
    mask = torch.cat([payload["prompt_mask"], payload["completion_mask"]], 1)
    T = payload["completion_ids"].shape[1]
    if critic == "reward_model":
        seq = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1)
        hidden = seq.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
        want = seq.score(hidden).squeeze(-1)[:, -T - 1:-1]
        assert_close(values, want * traj.mask_B_T)
    else:
        assert torch.equal(values, torch.zeros_like(values))  # zero-initialised head
    body_before = {k: v.detach().clone() for k, v in policy.value_model.named_parameters()}
    cfg = OnlineConfig(algorithm="ppo", num_generations=2, prompts_per_step=4, micro_batch_size=4, max_steps=2,
                       report_to="none", output_dir=str(tmp_path / "run"), learning_rate=1e-2)
    OnlineTrainer(policy, length_reward, ROWS, cfg).train()
    moved = [k for k, v in policy.value_model.named_parameters() if not torch.equal(v, body_before[k])]
    assert any(k.startswith("head") for k in moved) and any(k.startswith("body") for k in moved)
    assert not hasattr(unwrap(policy.reference().model), "value_model")  # the reference copies no critic
    policy.save(str(tmp_path / "final"))
    assert (tmp_path / "final" / "value_model.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))  # stock load of the policy alone


def test_critic_from_a_checkpoint_with_another_vocabulary_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "other"))
    model, tok = make_tiny_lm()
    with pytest.raises(ValueError, match="vocabulary"):
        CausalLMPolicy(model, tok, value_head=str(tmp_path / "other"))


def test_ppo_whiten_rewards_scales_the_kl_shaped_token_rewards(tmp_path, monkeypatch):
    """TRL's whiten_rewards: the KL-shaped per-token rewards are whitened over real tokens with the mean
    kept, (r - mean) / std + mean (unbiased std), before GAE."""
    from unialign.algos import advantage_estimators as estimators

    seen = []
    real_gae = estimators.gae
    monkeypatch.setattr(estimators, "gae", lambda r, v, m, g, lam: seen.append((r.clone(), m.clone())) or real_gae(r, v, m, g, lam))
    model, tok = make_tiny_lm()
    policy = CausalLMPolicy(model, tok, max_new_tokens=8, value_head=True)
    runs = {}
    for whiten in (False, True):
        torch.manual_seed(0)
        cfg = OnlineConfig(algorithm="ppo", num_generations=2, prompts_per_step=4, micro_batch_size=4, max_steps=1,
                           report_to="none", output_dir=str(tmp_path / str(whiten)), learning_rate=0.0,
                           whiten_rewards=whiten, seed=0)
        trainer = OnlineTrainer(policy, length_reward, ROWS, cfg)
        traj, _ = trainer.collect()
        runs[whiten] = seen[-1]
    (raw, mask), (whitened, mask2) = runs[False], runs[True]
    assert torch.equal(mask, mask2)
    x = raw[mask > 0].double()
    mean, std = x.mean(), x.std(unbiased=True)
    want = torch.zeros_like(raw, dtype=torch.float64)
    want[mask > 0] = (x - mean) / torch.sqrt(std**2 + 1e-8) + mean
    assert_close(whitened, want.to(whitened.dtype))


def test_overlong_buffer_tokens_from_a_share_of_the_limit_or_a_count():
    from unialign.trainers.online import overlong_cache_tokens

    assert overlong_cache_tokens(0.2, 20480) == 4096  # DAPO's own numbers
    assert (overlong_cache_tokens(0.2, 32), overlong_cache_tokens(0.2, 26), overlong_cache_tokens(0.01, 26)) == (6, 5, 1)
    assert (overlong_cache_tokens(4, 26), overlong_cache_tokens(100, 26)) == (4, 26)
    assert overlong_cache_tokens(0, 26) == overlong_cache_tokens(0.2, None) == 0
    with pytest.raises(ValueError, match="overlong_cache_len"):
        overlong_cache_tokens(-1, 26)


@pytest.mark.parametrize("override, cache", [(None, 2), (4, 4), (0, 0)])
def test_dapo_adds_the_soft_overlong_penalty_by_hand(tmp_path, override, cache):
    """DAPO eq. 13 with L_max = 8: the preset's buffer is 20 % of it (1.6 -> 2 tokens); a token count
    or 0 (off) overrides it. Task reward 0, so the shaped reward is the penalty alone."""
    trainer = make(tmp_path, reward=lambda prompts, completions: [0.0] * len(completions), algorithm="dapo",
                   dynamic_sampling=False, max_completion_length=8, overlong_cache_len=override)
    traj, _ = trainer.collect()
    lengths = traj.mask_B_T.sum(-1).tolist()
    start = 8 - cache
    expected = [0.0 if cache == 0 or n <= start else (start - n) / cache for n in lengths]
    assert_close(traj.rewards_B, torch.tensor(expected))
    assert cache == 0 or min(expected) < 0  # the tiny model runs to the limit: the penalty is exercised


def test_evaluator_runs_before_every_eval_steps_and_after(tmp_path):
    calls = []

    def evaluator():
        calls.append(trainer.step)
        return {"score": float(len(calls)), "grid": object()}  # non-numbers go to trackers as images only

    trainer = make(tmp_path, max_steps=4, eval_steps=2)
    trainer.evaluator = evaluator
    assert trainer.evaluate() == {"eval/score": 1.0}
    history = trainer.train()
    assert calls == [0, 2, 4]  # the final evaluation at step 4 is the scheduled one, not a second run
    assert trainer.evaluate() == {"eval/score": 3.0} and calls == [0, 2, 4]  # cached per step
    evals = [(h["step"], h["eval/score"]) for h in history if "eval/score" in h]
    assert evals == [(0, 1.0), (2, 2.0), (4, 3.0)]
    assert all("grid" not in k for h in history for k in h)
    assert (Path(tmp_path) / "reward_curve.png").exists()


def test_reward_function_metrics_are_logged(tmp_path):
    class Scores(list):
        pass

    def reward(prompts, completions):
        out = Scores(len(c) / 8.0 for c in completions)
        out.metrics = {"long": sum(len(c) > 4 for c in completions) / len(completions)}
        return out

    history = make(tmp_path, reward=reward, max_steps=1).train()
    assert 0.0 <= history[0]["reward/reward/long"] <= 1.0


def test_columns_some_rows_lack_reach_the_reward_aligned(tmp_path):
    """A column only some rows have (GenEval's ``exclude`` on counting prompts only) is None on the others, so
    every column stays as long as the batch and row-aligned."""
    seen = []

    def reward(prompts, completions, tag, exclude):
        seen.append((list(prompts), list(tag), list(exclude)))
        return [0.0] * len(prompts)

    rows = [{"prompt": "a", "tag": "x", "exclude": [1]}, {"prompt": "b", "tag": "y"}]
    trainer = make(tmp_path, reward=reward, rows=rows, prompts_per_step=2, num_generations=2)
    trainer.train_step()
    prompts, tags, excludes = seen[0]
    assert len(prompts) == len(tags) == len(excludes) == 4
    for p, t, e in zip(prompts, tags, excludes):
        assert (t, e) == (("x", [1]) if p == "a" else ("y", None))
