"""Tests for the reward contract (TRL signature, keyword filtering, validation), CombinedReward's
weighting and NaN rules, the per-item time limit and the reward registry."""

from __future__ import annotations

import functools
import math
import threading
import time

import numpy as np
import pytest
import torch

from unialign.rewards import REWARDS, CombinedReward, RewardFunction, completion_to_text, get_reward
from unialign.rewards.base import map_with_time_limit
from unialign.rewards.registry import resolve

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]
COLUMNS = {"answer": ["1", "2", "3"], "difficulty": [0.5, 1.0, 2.0]}


def length_reward(completions, **kwargs):  # TRL docs' example shape: no prompts parameter
    return [float(len(c)) for c in completions]


def answer_reward(prompts, completions, answer):  # no **kwargs: must not receive "difficulty"
    return [float(a) for a in answer]


def keyword_only_reward(prompts, completions, *, difficulty, scale=1.0):
    return [d * scale for d in difficulty]


def positional_only_reward(prompts, completions, /, answer):
    return [float(len(p)) + float(a) for p, a in zip(prompts, answer)]


class ConstantReward:
    """A class-based reward, as model rewards will be; also used as a registry factory target."""

    def __init__(self, value: float = 1.0):
        self.value = value

    def __call__(self, prompts, completions, **kwargs):
        return [self.value] * len(completions)


# ---- calling convention --------------------------------------------------------------------------

def test_kwargs_function_gets_everything_by_keyword():
    seen = {}

    def spy(completions, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(completions)

    RewardFunction(spy).score(PROMPTS, COMPLETIONS, COLUMNS)
    assert set(seen) == {"prompts", "answer", "difficulty"}
    assert seen["prompts"] == PROMPTS


def test_function_without_kwargs_gets_only_what_it_accepts():
    assert RewardFunction(answer_reward).score(PROMPTS, COMPLETIONS, COLUMNS).tolist() == [1.0, 2.0, 3.0]
    assert RewardFunction(length_reward).score(PROMPTS, COMPLETIONS, COLUMNS).tolist() == [1.0, 2.0, 3.0]


def test_keyword_only_positional_only_partial_and_class_instances():
    assert RewardFunction(keyword_only_reward).score(PROMPTS, COMPLETIONS, COLUMNS).tolist() == [0.5, 1.0, 2.0]
    assert RewardFunction(positional_only_reward).score(PROMPTS, COMPLETIONS, COLUMNS).tolist() == [3.0, 4.0, 5.0]
    scaled = functools.partial(keyword_only_reward, scale=2.0)
    assert RewardFunction(scaled).score(PROMPTS, COMPLETIONS, COLUMNS).tolist() == [1.0, 2.0, 4.0]
    assert RewardFunction(scaled).name == "keyword_only_reward"
    rf = RewardFunction(ConstantReward(0.25))
    assert rf.name == "ConstantReward"
    assert rf.score(PROMPTS, COMPLETIONS).tolist() == [0.25] * 3


def test_fixed_kwargs_override_columns_and_are_validated():
    rf = RewardFunction(keyword_only_reward, kwargs={"scale": 10.0, "difficulty": [1.0, 1.0, 1.0]})
    assert rf.score(PROMPTS, COMPLETIONS, COLUMNS).tolist() == [10.0, 10.0, 10.0]
    with pytest.raises(TypeError, match="answer_reward.*does not take.*'scale'"):
        RewardFunction(answer_reward, kwargs={"scale": 2.0})


def test_missing_column_names_function_and_column():
    with pytest.raises(TypeError, match=r"answer_reward.*\['answer'\].*columns: \['difficulty'\]"):
        RewardFunction(answer_reward).score(PROMPTS, COMPLETIONS, {"difficulty": [1, 2, 3]})


def test_trl_style_call_returns_raw_list_and_has_dunder_name():
    rf = RewardFunction(answer_reward, name="ans")
    assert rf(prompts=PROMPTS, completions=COMPLETIONS, **COLUMNS) == [1.0, 2.0, 3.0]
    assert rf.__name__ == "ans"


# ---- output validation ---------------------------------------------------------------------------

def test_wrong_length_raises_naming_the_function():
    def short(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    with pytest.raises(ValueError, match=r"'short' returned 2 scores for a batch of 3"):
        RewardFunction(short).score(PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match=r"'short' returned 2 scores"):
        CombinedReward([length_reward, short])(PROMPTS, COMPLETIONS)


@pytest.mark.parametrize("bad, error", [("1.0", TypeError), (5.0, TypeError), ([["x"]] * 3, TypeError),
                                        (torch.zeros(3, 1), ValueError)])
def test_non_numeric_or_misshapen_output_raises(bad, error):
    def broken(completions, **kwargs):
        return bad

    with pytest.raises(error, match="'broken'"):
        RewardFunction(broken).score(PROMPTS, COMPLETIONS)


def test_tensor_numpy_bool_and_none_outputs():
    outputs = [torch.tensor([1.0, 2.0, 3.0]), np.array([1, 2, 3]), [True, False, None], (np.float32(0.5), 1, None)]
    expected = [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 0.0, math.nan], [0.5, 1.0, math.nan]]
    for out, want in zip(outputs, expected):
        got = RewardFunction(lambda completions, out=out, **kw: out).score(PROMPTS, COMPLETIONS)
        assert got.dtype == torch.float64
        np.testing.assert_array_equal(got.numpy(), np.array(want, dtype=np.float64))


def test_column_length_mismatch_raises():
    with pytest.raises(ValueError, match="column 'answer' has 2 values for a batch of 3"):
        RewardFunction(length_reward).score(PROMPTS, COMPLETIONS, {"answer": ["1", "2"]})


# ---- combination ---------------------------------------------------------------------------------

def test_weighted_sum_by_hand():
    combined = CombinedReward([length_reward, answer_reward], weights=[0.5, -2.0])
    out = combined(PROMPTS, COMPLETIONS, COLUMNS)
    # lengths 1,2,3 ; answers 1,2,3  ->  0.5*len - 2*answer = -1.5, -3, -4.5
    assert out.rewards_B.dtype == torch.float64
    assert out.rewards_B.tolist() == [-1.5, -3.0, -4.5]
    assert out.per_function["length_reward"].tolist() == [1.0, 2.0, 3.0]
    assert out.per_function["answer_reward"].tolist() == [1.0, 2.0, 3.0]
    assert out.num_nonfinite == 0
    assert combined.weights == [0.5, -2.0]


def test_reward_function_weight_used_without_weights_argument():
    out = CombinedReward([RewardFunction(length_reward, weight=3.0), answer_reward])(PROMPTS, COMPLETIONS, COLUMNS)
    assert out.rewards_B.tolist() == [4.0, 8.0, 12.0]


def test_none_gives_nan_and_is_counted():
    def sometimes(completions, **kwargs):
        return [1.0, None, 0.0]

    def infinite(completions, **kwargs):
        return [0.0, 0.0, math.inf]

    out = CombinedReward([length_reward, sometimes, infinite])(PROMPTS, COMPLETIONS)
    assert out.rewards_B[0].item() == 2.0
    assert math.isnan(out.rewards_B[1].item()) and math.isnan(out.rewards_B[2].item())  # inf -> NaN, not inf
    assert out.num_nonfinite == 2
    assert math.isnan(out.per_function["sometimes"][1].item())
    metrics = out.metrics()
    assert metrics["reward/mean"] == 2.0
    assert metrics["reward/frac_nonfinite"] == pytest.approx(2 / 3)
    assert metrics["rewards/sometimes/mean"] == 0.5


def test_zero_weight_component_never_poisons_total():
    def missing(completions, **kwargs):
        return [None] * len(completions)

    out = CombinedReward([length_reward, missing], weights=[1.0, 0.0])(PROMPTS, COMPLETIONS)
    assert out.rewards_B.tolist() == [1.0, 2.0, 3.0]
    assert out.num_nonfinite == 0
    assert torch.isnan(out.per_function["missing"]).all()


def test_skip_mode_is_trl_nansum():
    def first_only(completions, **kwargs):
        return [10.0, None, None]

    def second_only(completions, **kwargs):
        return [None, 20.0, None]

    out = CombinedReward([first_only, second_only], on_nonfinite="skip")(PROMPTS, COMPLETIONS)
    assert out.rewards_B[:2].tolist() == [10.0, 20.0]
    assert math.isnan(out.rewards_B[2].item())
    assert out.num_nonfinite == 1


def test_registry_names_duplicates_and_argument_errors():
    out = CombinedReward(["math_accuracy", "math_format"])(["q"], ["#### 7"], {"answer": ["#### 7"]})
    assert out.rewards_B.tolist() == [2.0]
    with pytest.raises(ValueError, match="unique.*length_reward"):
        CombinedReward([length_reward, length_reward])
    assert len(CombinedReward([length_reward, RewardFunction(length_reward, name="len2")]).functions) == 2
    with pytest.raises(ValueError, match="2 weights for 1"):
        CombinedReward([length_reward], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        CombinedReward([])
    with pytest.raises(ValueError, match="on_nonfinite"):
        CombinedReward([length_reward], on_nonfinite="zero")


def test_empty_batch():
    out = CombinedReward([length_reward])([], [])
    assert out.rewards_B.shape == (0,) and out.num_nonfinite == 0


# ---- completions ---------------------------------------------------------------------------------

def test_completion_to_text_plain_and_conversational():
    assert completion_to_text("hi") == "hi"
    assert completion_to_text([{"role": "assistant", "content": "#### 3"}]) == "#### 3"
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
             {"role": "tool", "content": "t"}, {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                                                {"type": "image"}, {"text": "2"}]}]
    assert completion_to_text(convo) == "a2"
    assert completion_to_text({"role": "assistant", "content": "x"}) == "x"
    assert completion_to_text(None) == "" and completion_to_text([]) == ""
    with pytest.raises(TypeError):
        completion_to_text(3.0)


# ---- time limit ----------------------------------------------------------------------------------

def test_map_with_time_limit_defaults_slow_and_failing_items_keeps_order():
    release = threading.Event()

    def fn(x):
        if x == "slow":
            release.wait(5.0)
            return "late"
        if x == "boom":
            raise RuntimeError("bug")
        return x * 2

    t0 = time.perf_counter()
    out = map_with_time_limit(fn, [1, "slow", 2, "boom", 3], timeout_s=0.05, default=-1)
    assert time.perf_counter() - t0 < 1.0
    assert out == [2, -1, 4, -1, 6]
    release.set()  # the abandoned worker finishes now and must not write into a returned list
    time.sleep(0.05)
    assert out == [2, -1, 4, -1, 6]
    assert map_with_time_limit(fn, [], 0.1, 0) == []


# ---- registry ------------------------------------------------------------------------------------


def model_reward_kwargs() -> dict[str, dict]:
    """Rewards that load a model need one: the demo package's tiny CLIP / head need no network (its
    ``register()`` also adds its shape verifiers, so they are checked below too)."""
    from unialign.embedded import register
    from unialign.embedded.shapes_world import reward_kwargs

    register()
    return {n: reward_kwargs(n) for n in ("aesthetic", "clip_score", "geneval")}


def test_every_registered_reward_resolves_to_a_callable(tmp_path):
    from transformers import LlamaForSequenceClassification

    from tests.conftest import make_tiny_lm
    from unialign.embedded import VLM_DIR
    from unialign.text.reward_model import RewardModel

    lm, tok = make_tiny_lm()
    lm.config.num_labels = 1
    RewardModel(LlamaForSequenceClassification(lm.config), tok).save(str(tmp_path / "rm"))
    from tests.rewards.test_pickscore_hps import tiny_hps, tiny_pickscore

    kwargs = {**model_reward_kwargs(), "reward_model": {"path": str(tmp_path / "rm")},
              "pairwise": {"score": "math_format"},
              "pickscore": tiny_pickscore(tmp_path / "pickscore"), "hps": tiny_hps(tmp_path / "hps"),
              "vlm_judge": {"model_name_or_path": str(VLM_DIR)},  # the shipped tiny VLM as the judge
              "per_frame": {"reward": "jpeg_compressibility"},
              "temporal_consistency": {}}
    import importlib.util

    for name, path in REWARDS.items():
        assert callable(resolve(path)), name
        if name == "ocr" and importlib.util.find_spec("rapidocr_onnxruntime") is None:
            continue  # the ocr extra is not installed: tests/rewards/test_ocr.py checks its message
        reward = get_reward(name, **kwargs.get(name, {}))
        assert reward.name == name


def test_get_reward_binds_kwargs_instantiates_classes_and_rejects_unknown():
    fmt = get_reward("math_format", style="think_answer")
    assert fmt(["q"], ["<think>t</think><answer>1</answer>"]) == [1.0]
    with pytest.raises(ValueError, match="unknown reward 'nope'.*math_accuracy"):
        get_reward("nope")
    const = get_reward("tests.rewards.test_base:ConstantReward", value=0.5)
    assert const.name == "ConstantReward"
    assert const.score(PROMPTS, COMPLETIONS).tolist() == [0.5] * 3
    with pytest.raises(ValueError, match="module:attribute"):
        resolve("no_colon")
