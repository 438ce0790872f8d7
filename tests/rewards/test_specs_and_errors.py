"""Reward specs (registry names, TRL's dotted path, module:function, file.py:function), reward functions
that fail (named with the sample, or skipped and counted) and huge rewards kept in float64."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from unialign import algos
from unialign.rewards import CombinedReward, RewardFunction, get_reward
from unialign.rewards.base import RewardError
from unialign.rewards.registry import REWARDS, resolve_reward

PROMPTS = ["what is 1+1?", "x" * 500, "what is 3+3?"]
COMPLETIONS = ["2", "4", "6"]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "my_rewards.py").write_text("def brevity(completions, **kw):\n    return [-len(c) for c in completions]\n")
    (tmp_path / "loose.py").write_text("def brevity(completions, **kw):\n    return [1.0 for c in completions]\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("my_pkg")]:
        del sys.modules[name]


def test_every_spec_form_resolves(user_module):
    assert get_reward("math_accuracy").name == "math_accuracy"
    dotted = get_reward("my_pkg.my_rewards.brevity")  # TRL's form, importable from the current directory
    assert dotted.name == "brevity" and dotted(["p"], ["abc"]) == [-3]
    assert get_reward("my_pkg.my_rewards:brevity")(["p"], ["ab"]) == [-2]
    in_file = get_reward(f"{user_module / 'loose.py'}:brevity")
    assert in_file(["p"], ["a"]) == [1.0]
    assert get_reward("./loose.py:brevity")(["p"], ["a"]) == [1.0]


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown reward 'nope'; registered: .*math_accuracy.*'path/to/file.py:function'"),
    ("no_such_pkg.mod.fn", "no module named 'no_such_pkg'"),
    ("my_pkg.my_rewards.missing", "has no attribute 'missing' .callables there: brevity"),
    ("missing.py:fn", "no such file 'missing.py'"),
    ("./broken.py:fn", "running .*broken.py' failed: RuntimeError: boom at import"),
    ("loose.py", "name the function in the file too"),
])
def test_bad_specs_are_one_clear_value_error(user_module, spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward(spec)


def test_registry_names_are_resolved_without_building():
    for name in REWARDS:
        target, label = resolve_reward(name)
        assert callable(target) and label == name


def flaky(prompts, completions):
    if any("3+3" in p for p in prompts):
        raise KeyError("no answer")
    return [1.0] * len(completions)


def text_at_one(prompts, completions):
    return [1.0, "one", 2.0][: len(completions)] if len(completions) == 3 else [1.0]


def test_a_raising_reward_names_the_function_and_the_sample():
    where = r"at test_specs_and_errors.py:\d+ on sample 2 \(prompt 'what is 3\+3\?'\)"
    with pytest.raises(RewardError, match=r"'flaky' raised KeyError " + where):
        RewardFunction(flaky).score(PROMPTS, COMPLETIONS)
    with pytest.raises(RewardError, match=r"'text_at_one' returned str for sample 1 \(prompt 'xxx+\.\.\.'\)"):
        CombinedReward([text_at_one])(PROMPTS, COMPLETIONS)


def test_wrong_length_and_batch_only_failures_are_named():
    def short(completions, **kw):
        return [1.0]

    def batch_only(completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("cannot batch")
        return [0.5]

    with pytest.raises(RewardError, match="'short' returned 1 scores for a batch of 3"):
        RewardFunction(short).score(PROMPTS, COMPLETIONS)
    with pytest.raises(RewardError, match="'batch_only' raised RuntimeError at test_specs_and_errors.py:[0-9]+ on a batch"):
        RewardFunction(batch_only).score(PROMPTS, COMPLETIONS)


def test_skip_counts_the_failed_samples_and_makes_them_nan():
    def ok(completions, **kw):
        return [float(c) for c in completions]

    out = CombinedReward([ok, flaky, text_at_one], on_error="skip")(PROMPTS, COMPLETIONS)
    assert out.rewards_B[0].item() == 4.0  # 2 + 1 + 1 (flaky's one-by-one retry scored samples 0 and 1)
    assert math.isnan(out.rewards_B[1].item()) and math.isnan(out.rewards_B[2].item())
    assert out.num_errors == 2 and out.errors_per_function == {"ok": 0, "flaky": 1, "text_at_one": 1}
    assert out.per_function["flaky"][:2].tolist() == [1.0, 1.0]
    # even TRL's nansum mode leaves a failed sample out rather than summing the rest
    skip_nan = CombinedReward([ok, flaky], on_nonfinite="skip")(PROMPTS, COMPLETIONS, on_error="skip")
    assert math.isnan(skip_nan.rewards_B[2].item()) and skip_nan.num_errors == 1
    assert out.metrics()["reward/num_errors"] == 2.0


def test_huge_finite_rewards_keep_their_advantages():
    big = [1e20, 2e20, 3e20, 4e20]
    out = CombinedReward([lambda completions, **kw: big])(["p"] * 4, ["c"] * 4)
    assert out.rewards_B.dtype == torch.float64
    adv_big = algos.group_advantages(out.rewards_B, 4, "group")
    adv_small = algos.group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), 4, "group")
    assert torch.allclose(adv_big, adv_small, rtol=1e-3) and adv_big.abs().min() > 0.3
    # the same rewards in float32 are what used to happen: the variance overflows and every advantage is 0
    assert algos.group_advantages(out.rewards_B.float(), 4, "group").abs().max() == 0


def test_a_reward_class_that_needs_arguments_says_which():
    with pytest.raises(ValueError, match=r"reward 'reward_model' needs path \(e.g. get_reward\('reward_model', path=...\)\)"):
        get_reward("reward_model")


def test_rewards_beyond_float64_group_statistics_are_errors_not_silent_zero_advantages():
    def huge(prompts, completions, **_):
        return [0.0, 1e200, 10**400, 2.0]

    fn = RewardFunction(huge)
    with pytest.raises(RewardError, match=r"returned 1e\+200 for sample 1 \(prompt 'p'\): beyond \+-1e\+150"):
        fn.score(["p"] * 4, ["c"] * 4)
    scores, _, errors = fn.score_checked(["p"] * 4, ["c"] * 4, on_error="skip")
    assert errors.tolist() == [False, True, True, False] and scores[0] == 0.0 and scores[3] == 2.0
    assert math.isnan(scores[1]) and math.isnan(scores[2])
