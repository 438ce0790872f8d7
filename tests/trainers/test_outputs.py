"""What a person reads: strict-JSON summaries, where outputs went, curves chosen per algorithm, honest
metric names; reward functions that fail (named, checkpointed, or skipped and counted); huge rewards."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.trainers.test_online import make
from unialign.files import json_safe
from unialign.registry import get_algorithm
from unialign.rewards.base import RewardError
from unialign.trainers import finish_run
from unialign.trainers.online import curve_keys, explained_variance
from unialign.trainers.outputs import smoothed


def strict_loads(text: str):
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_summary_is_strict_json_and_printed_as_json_with_the_folder(tmp_path, capsys):
    trainer = make(tmp_path, max_steps=1)
    trainer.train()
    capsys.readouterr()
    summary = {"before": math.nan, "after": math.inf, "parts": [1.0, -math.inf], "n": torch.tensor(3),
               "nested": {"x": float("nan")}}
    finish_run(trainer.acc, trainer.cfg, summary, lambda path: None)
    saved = strict_loads((tmp_path / "summary.json").read_text())
    assert saved["before"] is None and saved["after"] is None and saved["parts"] == [1.0, None]
    assert saved["n"] == 3 and saved["nested"] == {"x": None} and saved["config"]["max_steps"] == 1
    out = capsys.readouterr().out
    assert f"outputs in {tmp_path.resolve()}" in out
    printed = strict_loads(out[out.index("{"):])
    assert printed["before"] is None and "config" not in printed and "algorithm_spec" not in printed
    spec = trainer.cfg.algo_spec()  # the knobs as run, resolved from the preset (config keeps only what was set)
    assert saved["algorithm_spec"]["name"] == spec.name and saved["algorithm_spec"]["epsilon"] == spec.epsilon


def test_json_safe_by_hand():
    assert json_safe({1: (math.nan, 2, True, None, "s")}) == {"1": [None, 2, True, None, "s"]}


def test_metric_names_say_what_they_are(tmp_path):
    history = make(tmp_path, max_steps=1).train()
    h = history[-1]
    assert "steps_per_second" not in h
    assert h["tokens_per_second"] > 0 and h["samples_per_second"] > 0 and h["step_seconds"] > 0
    # tokens / samples per second agree with the batch: 2 prompts x 4 generations
    assert h["tokens_per_second"] / h["samples_per_second"] == pytest.approx(h["completion_length"], rel=1e-6)


def history_of(**series):
    n = len(next(iter(series.values())))
    return [{"step": i + 1, **{k: v[i] for k, v in series.items()}} for i in range(n)]


def test_curve_panels_per_algorithm():
    common = dict(loss=[0.3, 0.2, 0.1], lr=[1e-5, 2e-5, 2e-5], clip_frac=[0.0, 0.1, 0.0])
    grpo = history_of(**common, **{"reward/mean": [0.1, 0.2, 0.3], "kl": [0.0, 0.01, 0.02],
                                    "frac_reward_zero_std": [0.5, 0.25, 0.5], "entropy": [1.0, 0.9, 0.8]})
    assert curve_keys(get_algorithm("grpo"), grpo) == ["reward/mean", "loss", "kl", "lr", "clip_frac",
                                                      "frac_reward_zero_std", "entropy"]
    assert "kl" not in curve_keys(get_algorithm("grpo", beta=0.0), grpo)
    ppo = history_of(**common, **{"reward/mean": [0.1, 0.2, 0.3], "kl_seq": [0.0, 0.1, 0.2],
                                   "frac_reward_zero_std": [1.0, 1.0, 1.0], "value_loss": [1.0, 0.5, 0.4],
                                   "explained_variance": [-0.2, 0.1, 0.3], "eval/accuracy": [0.5, 0.6, 0.7]})
    assert curve_keys(get_algorithm("ppo"), ppo) == ["reward/mean", "eval/accuracy", "loss", "kl_seq", "lr",
                                                     "clip_frac", "value_loss", "explained_variance"]
    # DDPO: no entropy logged (constant in the weights); a constant lr or clip fraction is no panel either
    ddpo = history_of(**{"reward/mean": [0.1, 0.2, 0.3], "loss": [0.1, 0.1, 0.0], "lr": [1e-4] * 3,
                         "clip_frac": [0.0] * 3, "frac_reward_zero_std": [0.0, 0.5, 0.0]})
    assert curve_keys(get_algorithm("ddpo"), ddpo) == ["reward/mean", "loss"]


def test_smoothing_and_explained_variance_by_hand():
    assert smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)
    assert explained_variance(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), returns, mask) == pytest.approx(-3.0)


def test_a_failing_reward_is_named_and_earlier_steps_are_kept(tmp_path):
    def picky(prompts, completions):
        if picky.calls >= 2:  # the third step's batch fails; alone, the first sample fails too
            raise ZeroDivisionError("bad reward")
        if len(prompts) > 1:
            picky.calls += 1
        return [len(c) / 8.0 for c in completions]

    picky.calls = 0
    trainer = make(tmp_path, reward=picky, max_steps=4)
    with pytest.raises(RewardError, match=r"'picky' raised ZeroDivisionError at test_outputs.py:\d+ on sample 0 \(prompt '.*'\).*"
                                          r"steps 1-2 are saved in .*checkpoint-2"):
        trainer.train()
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["cursor"] == 4  # the failed step's prompts are drawn again on resume


def test_skipped_reward_errors_are_counted_and_excluded(tmp_path):
    def half_broken(prompts, completions):
        return [None if i % 2 else "oops" if i % 4 == 0 else 1.0 for i in range(len(completions))]

    trainer = make(tmp_path, reward=half_broken, max_steps=1, reward_errors="skip")
    traj, stats = trainer.collect()
    assert trainer.counters["reward_errors"] == 2  # samples 0 and 4 of 8 returned a string
    assert torch.isnan(traj.rewards_B[[0, 4]]).all()
    assert (traj.advantages_B_T[[0, 4]] == 0).all()
    with pytest.raises(ValueError, match="--reward_errors: 'ignore' is not one of raise, skip"):
        make(tmp_path / "bad", reward_errors="ignore")


def test_huge_finite_rewards_give_the_advantages_of_small_ones(tmp_path):
    def advantages(scale: float):
        trainer = make(tmp_path / str(scale), reward=lambda prompts, completions: [
            scale * (1 + i % 4) for i in range(len(completions))], max_steps=1)
        traj, _ = trainer.collect()
        return traj.advantages_B_T[:, 0]

    small, big = advantages(1.0), advantages(1e20)
    assert big.abs().min() > 0.3
    torch.testing.assert_close(big, small, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_preference_trainer_logs_held_out_pairs_every_eval_steps(tmp_path):
    from tests.conftest import make_tiny_lm
    from tests.trainers.test_preference import PAIRS, config
    from unialign.text.policy import CausalLMPolicy
    from unialign.trainers.preference import DPOObjective, PreferenceTrainer

    def trainer(eval_steps: int):
        model, tok = make_tiny_lm()
        objective = DPOObjective(CausalLMPolicy(model, tok, max_new_tokens=4), beta=0.5)
        return PreferenceTrainer(objective, PAIRS[:8], config(tmp_path / str(eval_steps), max_steps=2,
                                                              eval_steps=eval_steps), eval_rows=PAIRS[8:])

    plain, logged = trainer(0), trainer(1)
    calls = []
    log = logged.acc.log
    logged.acc.log = lambda values, step=None, **kw: (calls.append((step, sorted(values))), log(values, step, **kw))
    before = logged.evaluate()
    history = logged.train()
    evals = [(h["step"], h["eval/implicit_accuracy"]) for h in history if "eval/implicit_accuracy" in h]
    assert [s for s, _ in evals] == [0, 1, 2] and evals[0][1] == before["implicit_accuracy"]
    cached = {k.removeprefix("eval/"): v for k, v in logged._last_eval[1].items()}
    assert logged.evaluate() == cached and logged._last_eval[0] == 2  # cached: the final one
    assert [s for s, keys in calls if "eval/loss" in keys] == [0, 1, 2]
    plain.train()
    assert [h["loss"] for h in plain.history] == [h["loss"] for h in history if "loss" in h]
    assert (tmp_path / "1" / "loss_curve.png").exists()
