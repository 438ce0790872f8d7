"""Async rollouts (``--async_rollouts``): staleness 0 is the synchronous run bit for bit; stale batches come from the
lagging weights, carry their behaviour log-probs and are corrected; a killed async run resumes exactly."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from tests.trainers.test_online import capture_gradients, make, params
from unialign.config import validate
from unialign.dist import unwrap
from unialign.errors import UserError
from unialign.trainers import OnlineConfig
from unialign.trainers.async_rollouts import AsyncRollouts, rollout_seed

ASYNC = dict(async_rollouts=True)


def spread_reward(prompts, completions):
    """Varied rewards (the tiny model's completions are mostly of one length, which ``length_reward`` scores alike)."""
    return [sum(map(ord, c)) % 11 / 10 for c in completions]


def train_keeping_batches(trainer) -> tuple[dict, list]:
    """Train ``trainer`` (async) keeping a copy of every batch it trains on; returns (the initial weights of the
    unwrapped model, the batches)."""
    first = {k: v.detach().clone() for k, v in unwrap(trainer.policy.model).named_parameters()}
    batches, next_batch = [], trainer._async_batch

    def keep():
        traj, stats = next_batch()
        batches.append(copy.deepcopy(traj))
        return traj, stats

    trainer._async_batch = keep
    trainer.train()
    return first, batches


def keep_weights(trainer) -> list[dict]:
    """The trainer's weights before training, then after each update (appended as it trains)."""
    weights, update = [params(trainer)], trainer.update

    def recording(traj):
        out = update(traj)
        weights.append(params(trainer))
        return out

    trainer.update = recording
    return weights


def rewards(trainer) -> list[float]:
    return [h["reward/mean"] for h in trainer.history if "reward/mean" in h]


def test_staleness_zero_is_the_synchronous_run_bit_for_bit(tmp_path):
    sync = make(tmp_path / "sync", max_steps=3)
    sync.train()
    run = make(tmp_path / "async", max_steps=3, max_staleness=0, **ASYNC)
    threads = []
    sample = run.rollouts.view.sample

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        assert kwargs.get("generator") is None  # k = 0: the global RNG, as the synchronous loop draws it
        return sample(*args, **kwargs)

    run.rollouts.view.sample = spy
    run.train()
    assert threads and all(t.startswith("unialign-rollouts") for t in threads)  # sampled in the thread, on the copy
    assert rewards(run) == rewards(sync)
    a, b = params(sync), params(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["async/lag"] for h in run.history] == [0.0, 0.0, 0.0]


def test_stale_batches_come_from_the_lagging_weights_with_their_log_probs(tmp_path):
    """max_staleness 1: batch b is sampled from the weights before update b - 1; its behaviour log-probs are those
    weights' (checked against an independent forward of a model holding them), the old log-probs the current
    weights' (from the update), and the correction's metrics are logged."""
    trainer = make(tmp_path, spread_reward, max_steps=3, max_staleness=1, **ASYNC)
    weights = keep_weights(trainer)
    _, batches = train_keeping_batches(trainer)
    assert [h["async/lag"] for h in trainer.history] == [0.0, 1.0, 1.0]
    assert batches[0].rollout_logp_B_T is None  # batch 0 is trained by the weights it was sampled from
    model = copy.deepcopy(unwrap(trainer.policy.model))
    for b in (1, 2):  # sampled from the weights after update b - 1, i.e. weights[b - 1]
        traj = batches[b]
        assert traj.old_logp_B_T is None  # one optimizer step: the update's own forward gives the old log-probs
        model.load_state_dict(weights[b - 1], strict=False)
        logp, _, _ = trainer.policy._forward(model, traj.payload, False)
        torch.testing.assert_close(traj.rollout_logp_B_T, logp * traj.mask_B_T, rtol=0, atol=1e-5)
        model.load_state_dict(weights[b], strict=False)
        now, _, _ = trainer.policy._forward(model, traj.payload, False)
        assert ((now - logp).abs() * traj.mask_B_T).max() > 1e-4  # stale: the current weights differ
        assert "rollout/weight_mean" in trainer.history[b] and trainer.history[b]["rollout/mismatch_mean"] > 0


@pytest.mark.parametrize("mode,zero", [("mask", True), ("off", False)])
def test_stale_batches_are_reweighted_by_the_rollout_correction(tmp_path, mode, zero):
    """With weights that never move (the optimizer step recorded instead), every ratio old / behaviour is 1: MIS
    with cap 0.5 masks every token of a stale batch (no gradient), no correction leaves it."""
    trainer = make(tmp_path, spread_reward, max_steps=2, max_staleness=1, rollout_correction=mode, rollout_correction_cap=0.5,
                   **ASYNC)
    grads, seen = capture_gradients(trainer), []
    step = trainer.optimizer.step

    def record(*a, **k):
        step()
        seen.append(max(float(g.abs().max()) for g in grads.values()))

    trainer.optimizer.step = record
    trainer.train()
    assert seen[0] > 0  # batch 0: not stale, not corrected
    assert (seen[1] == 0) == zero


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_killed_async_run_resumes_as_the_uninterrupted_run(tmp_path, staleness):
    full = make(tmp_path / "full", spread_reward, max_steps=5, max_staleness=staleness, **ASYNC)
    full.train()
    killed = make(tmp_path / "cut", spread_reward, max_steps=5, max_staleness=staleness, save_steps=2, **ASYNC)
    update, calls = killed.update, []

    def die_at_third(traj):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return update(traj)

    killed.update = die_at_third
    with pytest.raises(KeyboardInterrupt):
        killed.train()
    assert killed.rollouts._executor is None  # the thread was stopped on the way out
    resumed = make(tmp_path / "cut", spread_reward, max_steps=5, max_staleness=staleness, save_steps=2,
                   resume_from_checkpoint="latest", **ASYNC)
    resumed.train()
    assert rewards(resumed) == rewards(full)
    assert all(h["reward/std"] > 0 for h in full.history)  # every batch moves the weights
    a, b = params(full), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_stale_batches_draw_from_their_own_generator_not_the_global_rng(tmp_path):
    """k > 0: every batch gets a generator of its own (a seed per batch and per process), the same in a rerun."""
    def seeds_of(run: str) -> list[int]:
        trainer = make(tmp_path / run, max_steps=3, max_staleness=1, **ASYNC)
        seeds, sample = [], trainer.rollouts.view.sample

        def spy(prompts, generator=None, record_logp=True):
            seeds.append(generator.initial_seed())
            return sample(prompts, generator=generator, record_logp=record_logp)

        trainer.rollouts.view.sample = spy
        trainer.train()
        return seeds

    first = seeds_of("a")
    assert len(first) == 3 and len(set(first)) == 3 and seeds_of("b") == first
    assert len({rollout_seed(0, 1, rank=r) for r in range(4)}) == 4


def test_async_rollouts_refuse_what_they_cannot_run(tmp_path):
    with pytest.raises(UserError, match="--async_rollouts: .*dynamic sampling"):
        validate(OnlineConfig(algorithm="dapo", async_rollouts=True))
    with pytest.raises(ValueError, match="cannot sample from a copy of its weights"):
        AsyncRollouts(object(), 1, 0, lambda *a: None)


def vllm_trainer(tmp_path, **kw):
    """``make`` with the policy on the vLLM path, its engine the stand-in of ``tests/text/test_vllm_engine.py``
    (a completion's first token follows its request's seed: two digits, then EOS)."""
    from tests.conftest import make_tiny_lm
    from tests.text.test_vllm_engine import build_engine
    from tests.trainers.test_online import ROWS
    from unialign.text.policy import CausalLMPolicy
    from unialign.text.rollout import VLLMRollout
    from unialign.trainers import OnlineTrainer

    model, tok = make_tiny_lm(seed=0)
    policy = CausalLMPolicy(model, tok, max_new_tokens=8)
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    policy.generation_backend = "vllm"  # the constructor refuses vllm on this CPU machine
    policy.rollout = VLLMRollout({})
    policy.rollout.engine, llm = build_engine(model, tok, script=lambda ids, k: (
        [digits[k % 10], digits[k // 10 % 10], tok.eos_token_id], [-0.5, -0.25, -0.125]))
    policy.rollout.fresh = True
    cfg = dict(num_generations=4, prompts_per_step=2, micro_batch_size=4, report_to="none",
               output_dir=str(tmp_path), learning_rate=1e-2, beta=0.0, seed=0, **kw)
    return OnlineTrainer(policy, spread_reward, ROWS, OnlineConfig(**cfg)), llm


def test_async_rollouts_on_vllm_push_each_batch_its_weights_and_seed_it_from_its_generator(tmp_path):
    """The same code path on vLLM (engine stand-in): the rollout thread drives the one engine, pushing the
    lagging copy's weights before each batch (batch b: the weights after update b - 1), never putting it to
    sleep; a stale batch's requests are seeded from the batch's own generator (the same on a rerun), its engine
    log-probs kept as behaviour log-probs for the correction."""
    trainer, llm = vllm_trainer(tmp_path / "a", max_steps=3, max_staleness=1, **ASYNC)
    weights = keep_weights(trainer)
    _, batches = train_keeping_batches(trainer)
    calls = [c for c in llm.calls if c[0] != "apply_model"]
    assert ("sleep", 2) not in calls and [h["async/lag"] for h in trainer.history] == [0.0, 1.0, 1.0]
    pushes = llm.served.loads[1:]  # [0]: the build; then one push before every batch
    assert len(pushes) == 3
    for b, pushed in enumerate(pushes):
        want = weights[max(b - 1, 0)]
        assert all(torch.equal(pushed[k], want[k]) for k in want)
    seeded = [c[2] for c in calls if c[0] == "generate"]
    assert all(isinstance(p, list) and len(p) == 2 for p in seeded)  # per request: two distinct prompts a batch
    for traj in batches[1:]:  # stale: the engine's log-probs are the behaviour log-probs
        assert traj.rollout_logp_B_T is not None and traj.rollout_logp_B_T[:, 0].eq(-0.5).all()
    rerun, llm2 = vllm_trainer(tmp_path / "b", max_steps=3, max_staleness=1, **ASYNC)
    rerun.train()
    again = [c[2] for c in llm2.calls if c[0] == "generate"]
    assert [[p.seed for p in ps] for ps in again] == [[p.seed for p in ps] for ps in seeded]
    assert len({p.seed for ps in seeded for p in ps}) == 6  # every batch and prompt its own
    assert rewards(rerun) == rewards(trainer)


def test_async_rollouts_build_the_vllm_engine_on_the_main_thread(tmp_path, monkeypatch):
    """A policy whose engine is not built yet gets it built by ``sampling_view`` (vLLM is not built from the
    rollout thread), from the copy's weights."""
    from tests.text.test_vllm_engine import build_engine
    from unialign.text import vllm_engine

    built = []
    trainer, _ = vllm_trainer(tmp_path, max_steps=1)
    stand_in = build_engine(unwrap(trainer.policy.model), trainer.policy.tokenizer)[0]

    def engine(model, tok, **options):
        built.append(threading.current_thread().name)
        return stand_in

    monkeypatch.setattr(vllm_engine, "VLLMEngine", engine)
    trainer.policy.rollout.engine = None
    view = trainer.policy.sampling_view(copy.deepcopy(unwrap(trainer.policy.model)))
    assert built == [threading.main_thread().name] and view.rollout.engine is trainer.policy.rollout.engine
    assert not view.rollout.sleep_after and trainer.policy.rollout.sleep_after


def test_several_updates_per_stale_batch_take_old_log_probs_from_the_current_weights(tmp_path):
    """num_iterations 2: a stale batch's old log-probs are computed once, before its update, by the current weights
    (PPO's ratio is then against them, the correction against the behaviour policy)."""
    trainer = make(tmp_path, spread_reward, max_steps=2, max_staleness=1, num_iterations=2, **ASYNC)
    seen, next_batch = [], trainer._async_batch

    def keep():
        traj, stats = next_batch()
        if stats["async/lag"] > 0:
            with torch.no_grad():
                now = trainer.policy.log_prob(traj) * traj.mask_B_T
            seen.append((traj.old_logp_B_T.clone(), now, traj.rollout_logp_B_T.clone()))
        return traj, stats

    trainer._async_batch = keep
    trainer.train()
    (old, now, behaviour), = seen
    torch.testing.assert_close(old, now, rtol=0, atol=1e-5)  # micro-batched vs one batch: float round-off
    assert ((old - behaviour).abs() * (old != 0)).max() > 1e-4  # the weights moved since the batch was sampled


def test_an_async_run_evaluates_and_checkpoints_between_steps_like_a_synchronous_one(tmp_path):
    """eval_steps and save_steps during an async run: the evaluation (under a preserved RNG) and the checkpoints
    change nothing in the run."""
    plain = make(tmp_path / "plain", spread_reward, max_steps=4, max_staleness=1, **ASYNC)
    plain.train()
    calls = []

    def evaluator():
        calls.append(1)
        return {"probe": float(torch.rand(1))}  # draws from the global RNG, which the evaluation preserves

    busy = make(tmp_path / "busy", spread_reward, max_steps=4, max_staleness=1, eval_steps=1, save_steps=1, **ASYNC)
    busy.evaluator = evaluator
    busy.train()
    assert len(calls) >= 4
    a, b = params(plain), params(busy)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_processes_run_async_rollouts_in_step(tmp_path):
    """torchrun, 2 processes, max_staleness 1: no deadlock between the rollout threads and the collectives, the
    ranks' weights stay equal (DDP), each rank samples its own prompts from its own generators."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    out = tmp_path / "ranks.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29641",
           "-m", "tests.trainers.dist_async", str(out)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(f"{out}.{rank}") for rank in (0, 1))
    assert a["lags"] == b["lags"] == [0.0, 1.0, 1.0]
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert a["completions"] != b["completions"]


def test_a_reward_error_mid_async_run_keeps_its_batch_for_the_resume(tmp_path):
    """reward_errors raise at step 3 of an async run: steps 1-2 are checkpointed with the failed step's batch still
    pending (sampled again on resume from its weights), so the fixed run ends where an uninterrupted one does."""
    from unialign.rewards.base import RewardError

    calls, bug = [], {"on": False}

    def flaky(prompts, completions):  # one name for the broken and the fixed reward (a resume compares them)
        calls.append(1)
        if bug["on"] and len(calls) == 3:
            raise ZeroDivisionError("the reward's bug")
        return spread_reward(prompts, completions)

    whole = make(tmp_path / "whole", flaky, max_steps=4, max_staleness=1, **ASYNC)
    whole.train()
    calls.clear()
    bug["on"] = True
    broken = make(tmp_path / "cut", flaky, max_steps=4, max_staleness=1, **ASYNC)
    with pytest.raises(RewardError, match="steps 1-2 are saved"):
        broken.train()
    bug["on"] = False
    fixed = make(tmp_path / "cut", flaky, max_steps=4, max_staleness=1, resume_from_checkpoint="latest", **ASYNC)
    fixed.train()
    assert rewards(fixed) == rewards(whole)
    a, b = params(whole), params(fixed)
    assert all(torch.equal(a[k], b[k]) for k in a)
