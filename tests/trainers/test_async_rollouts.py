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
    weights, update = [params(trainer)], trainer.update

    def keep_weights(traj):
        out = update(traj)
        weights.append(params(trainer))
        return out

    trainer.update = keep_weights
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
    trainer = make(tmp_path)
    trainer.policy.generation_backend = "vllm"
    with pytest.raises(ValueError, match="generation_backend='vllm'"):
        trainer.policy.sampling_view(unwrap(trainer.policy.model))


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
