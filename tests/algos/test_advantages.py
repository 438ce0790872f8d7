"""Reference-formula tests for unialign.algos.advantages.

Expected values are worked out by hand (arithmetic in comments) or with float64 numpy written here
from the published formulas; the code under test is never used to produce an expected value.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_close
from unialign.algos.advantages import PerPromptStatTracker, gae, group_advantages, rloo_advantages, whiten

F64 = torch.float64
NAN = float("nan")


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


# ----------------------------------------------------------------------------- numpy references
def np_grpo(rewards: np.ndarray, G: int, scale: str, eps: float = 1e-4) -> np.ndarray:
    """GRPO (Shao et al. 2024): A = (r - mean_group) / (std + eps), unbiased std; non-finite -> 0,
    excluded from every statistic."""
    r = rewards.reshape(-1, G).astype(np.float64)
    out = np.zeros_like(r)
    finite_all = r[np.isfinite(r)]
    batch_std = np.std(finite_all, ddof=1) if finite_all.size > 1 else 0.0
    for p in range(r.shape[0]):
        ok = np.isfinite(r[p])
        vals = r[p][ok]
        mean = vals.mean() if vals.size else 0.0
        std = np.std(vals, ddof=1) if vals.size > 1 else 0.0
        centred = vals - mean
        if scale == "group":
            out[p][ok] = centred / (std + eps)
        elif scale == "batch":
            out[p][ok] = centred / (batch_std + eps)
        else:
            out[p][ok] = centred
    return out.reshape(-1)


def np_rloo(rewards: np.ndarray, G: int) -> np.ndarray:
    """RLOO (Kool et al. 2019): A_i = r_i - mean_{j != i, j finite} r_j; explicit loop."""
    r = rewards.reshape(-1, G).astype(np.float64)
    out = np.zeros_like(r)
    for p in range(r.shape[0]):
        idx = [i for i in range(G) if np.isfinite(r[p, i])]
        if len(idx) < 2:
            continue
        for i in idx:
            others = [r[p, j] for j in idx if j != i]
            out[p, i] = r[p, i] - sum(others) / len(others)
    return out.reshape(-1)


class NpDDPOTracker:
    """ddpo-pytorch stat_tracking.PerPromptStatTracker, re-typed in numpy (plus: non-finite rewards
    are skipped and get advantage 0)."""

    def __init__(self, buffer_size: int, min_count: int):
        self.buffer_size, self.min_count, self.stats = buffer_size, min_count, {}

    def update(self, prompts, rewards):
        prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
        ok = np.isfinite(rewards)
        adv = np.zeros_like(rewards)
        for prompt in np.unique(prompts):
            sel = (prompts == prompt) & ok
            pr = rewards[sel]
            self.stats.setdefault(prompt, deque(maxlen=self.buffer_size)).extend(pr)  # extend BEFORE stats
            if len(self.stats[prompt]) < self.min_count:
                mean, std = np.mean(rewards[ok]), np.std(rewards[ok]) + 1e-6  # whole batch, population std
            else:
                mean, std = np.mean(self.stats[prompt]), np.std(self.stats[prompt]) + 1e-6
            adv[sel] = (pr - mean) / std
        return adv


def np_gae(r: np.ndarray, v: np.ndarray, m: np.ndarray, gamma: float, lam: float):
    """GAE (Schulman et al. 2016, eq. 16) on the unmasked steps of each row only (masked steps are
    skipped, V = 0 after the last unmasked step). Plain python loops; 0 at masked steps."""
    B, T = r.shape
    adv, ret = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        steps = [t for t in range(T) if m[b, t]]
        next_v, next_a = 0.0, 0.0
        for t in reversed(steps):
            delta = r[b, t] + gamma * next_v - v[b, t]
            a = delta + gamma * lam * next_a
            adv[b, t], ret[b, t] = a, a + v[b, t]
            next_v, next_a = v[b, t], a
    return adv, ret


# ----------------------------------------------------------------------------- group_advantages
def test_group_advantages_by_hand():
    # group 1: [1, 2, 3] mean 2, unbiased std sqrt((1+0+1)/2) = 1 -> [-1, 0, 1] / (1 + 1e-4)
    # group 2: [0, 0, 6] mean 2, unbiased std sqrt((4+4+16)/2) = sqrt(12) -> [-2, -2, 4] / (sqrt(12) + 1e-4)
    adv = group_advantages(t64([1, 2, 3, 0, 0, 6]), group_size=3)
    s = math.sqrt(12)
    expected = [-1 / 1.0001, 0.0, 1 / 1.0001, -2 / (s + 1e-4), -2 / (s + 1e-4), 4 / (s + 1e-4)]
    assert_close(adv, expected)


def test_group_advantages_batch_scale_by_hand():
    # all 6 rewards [1,2,3,0,0,6]: mean 2, squared deviations 1,0,1,4,4,16 = 26 -> unbiased std sqrt(26/5)
    adv = group_advantages(t64([1, 2, 3, 0, 0, 6]), group_size=3, scale="batch")
    s = math.sqrt(26 / 5) + 1e-4
    assert_close(adv, [-1 / s, 0.0, 1 / s, -2 / s, -2 / s, 4 / s])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_numpy(scale):
    rng = np.random.default_rng(0)
    r = rng.normal(size=24)
    assert_close(group_advantages(t64(r), 6, scale=scale), np_grpo(r, 6, scale))


def test_dr_grpo_is_grpo_numerator():
    # Dr.GRPO (scale="none") = GRPO's numerator r - mean; GRPO = that / (unbiased std + 1e-4).
    rng = np.random.default_rng(1)
    r = rng.normal(size=(5, 4))
    centred = r - r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, ddof=1, keepdims=True)
    dr = group_advantages(t64(r.reshape(-1)), 4, scale="none")
    grpo = group_advantages(t64(r.reshape(-1)), 4, scale="group")
    assert_close(dr, centred.reshape(-1))
    assert_close(grpo, (centred / (std + 1e-4)).reshape(-1))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_zero_variance_group(scale):
    # group [2, 2, 2] has std 0: advantage exactly 0, never NaN; the other group is unaffected.
    adv = group_advantages(t64([2, 2, 2, 0, 1, 2]), 3, scale=scale)
    assert torch.isfinite(adv).all()
    assert_close(adv[:3], [0.0, 0.0, 0.0])
    # whole batch constant (batch std 0 too)
    adv_all = group_advantages(t64([5.0] * 6), 3, scale=scale)
    assert_close(adv_all, [0.0] * 6)


def test_group_advantages_nan_excluded_from_baseline():
    # group [1, nan, 3, 5]: finite [1, 3, 5], mean 3, unbiased std sqrt((4+0+4)/2) = 2
    # -> [-2/2.0001, 0 (NaN -> 0), 0, 2/2.0001]; inf is treated the same way.
    adv = group_advantages(t64([1, NAN, 3, 5, 1, float("inf"), 3, 5]), 4)
    expected = [-2 / 2.0001, 0.0, 0.0, 2 / 2.0001]
    assert_close(adv, expected * 2)
    # a group with a single finite reward: centred 0, std undefined -> 0
    assert_close(group_advantages(t64([NAN, 4.0, NAN]), 3), [0.0, 0.0, 0.0])
    # Dr.GRPO: centring only over finite rewards: [1-3, 0, 3-3, 5-3]
    assert_close(group_advantages(t64([1, NAN, 3, 5]), 4, scale="none"), [-2.0, 0.0, 0.0, 2.0])


def test_group_advantages_nan_batch_scale():
    r = np.array([1, NAN, 3, 5, 0, 2, 2, 8.0])
    assert_close(group_advantages(t64(r), 4, scale="batch"), np_grpo(r, 4, "batch"))


@pytest.mark.parametrize(
    "rewards,G,kw",
    [
        (torch.zeros(2, 3), 3, {}),      # not 1-D
        (torch.zeros(6), 4, {}),         # not a whole number of groups
        (torch.zeros(6), 0, {}),         # empty group
        (torch.zeros(6), 3, {"scale": "std"}),
    ],
)
def test_group_advantages_bad_arguments(rewards, G, kw):
    with pytest.raises(ValueError):
        group_advantages(rewards, G, **kw)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=20, max_size=20),
    st.sampled_from(["group", "batch", "none"]),
)
def test_group_advantages_property(P, G, values, scale):
    r = np.array(values[: P * G])
    assert_close(group_advantages(t64(r), G, scale=scale), np_grpo(r, G, scale))


# ----------------------------------------------------------------------------- rloo
def test_rloo_by_hand():
    # group [1, 2, 3, 6]: baselines (2+3+6)/3 = 11/3, (1+3+6)/3 = 10/3, (1+2+6)/3 = 3, (1+2+3)/3 = 2
    # -> [1 - 11/3, 2 - 10/3, 3 - 3, 6 - 2] = [-8/3, -4/3, 0, 4]
    # group [5, 5, 5, 5]: all 0
    adv = rloo_advantages(t64([1, 2, 3, 6, 5, 5, 5, 5]), 4)
    assert_close(adv, [-8 / 3, -4 / 3, 0.0, 4.0, 0, 0, 0, 0])


def test_rloo_nan_excluded():
    # group [1, nan, 3, 5]: k = 3; 1 - (3+5)/2 = -3, NaN -> 0, 3 - (1+5)/2 = 0, 5 - (1+3)/2 = 3
    # group [nan, 7, nan, nan]: fewer than two finite rewards -> 0
    adv = rloo_advantages(t64([1, NAN, 3, 5, NAN, 7, NAN, NAN]), 4)
    assert_close(adv, [-3.0, 0.0, 0.0, 3.0, 0, 0, 0, 0])


def test_rloo_matches_numpy():
    rng = np.random.default_rng(2)
    r = rng.normal(size=30)
    r[[3, 17]] = np.nan
    assert_close(rloo_advantages(t64(r), 5), np_rloo(r, 5))


def test_rloo_bad_arguments():
    with pytest.raises(ValueError):
        rloo_advantages(torch.zeros(7), 2)
    with pytest.raises(ValueError):
        rloo_advantages(torch.zeros(2, 2), 2)


# ----------------------------------------------------------------------------- PerPromptStatTracker
def test_stat_tracker_by_hand():
    tr = PerPromptStatTracker(buffer_size=4, min_count=3)
    # step 1: a -> buffer [1, 2] (< 3), b -> [5] (< 3): both use the whole batch [1, 2, 5]:
    # mean 8/3, population var ((5/3)^2 + (2/3)^2 + (7/3)^2)/3 = (25+4+49)/27 = 78/27
    adv = tr.update(["a", "a", "b"], t64([1, 2, 5]))
    s = math.sqrt(78 / 27) + 1e-6
    assert_close(adv, [(1 - 8 / 3) / s, (2 - 8 / 3) / s, (5 - 8 / 3) / s])
    # step 2: a -> [1, 2, 3]: mean 2, pop std sqrt(2/3); b -> [5, 4, 6]: mean 5, pop std sqrt(2/3)
    adv = tr.update(["a", "b", "b"], t64([3, 4, 6]))
    s = math.sqrt(2 / 3) + 1e-6
    assert_close(adv, [(3 - 2) / s, (4 - 5) / s, (6 - 5) / s])
    # step 3: a extended by [4, 5, 6] BEFORE stats, maxlen 4 -> [3, 4, 5, 6]: mean 4.5, pop std sqrt(1.25)
    adv = tr.update(["a", "a", "a"], t64([4, 5, 6]))
    s = math.sqrt(1.25) + 1e-6
    assert_close(adv, [(4 - 4.5) / s, (5 - 4.5) / s, (6 - 4.5) / s])
    assert list(tr.stats["a"]) == [3.0, 4.0, 5.0, 6.0]


def test_stat_tracker_matches_ddpo_reference_and_state_dict():
    rng = np.random.default_rng(3)
    ours, ref = PerPromptStatTracker(buffer_size=6, min_count=4), NpDDPOTracker(6, 4)
    names = ["cat", "dog", "fish"]
    for step in range(6):
        prompts = [names[i] for i in rng.integers(0, 3, size=8)]
        r = rng.normal(size=8)
        if step == 2:
            r[1] = np.nan
        if step == 4:  # continue from a saved state in a fresh tracker
            saved = ours.state_dict()
            ours = PerPromptStatTracker(1, 1)
            ours.load_state_dict(saved)
        adv = ours.update(prompts, t64(r))
        assert_close(adv, ref.update(prompts, r), msg=f"step {step}")


def test_stat_tracker_nan_not_buffered():
    tr = PerPromptStatTracker(buffer_size=8, min_count=1)
    # a: finite [1, 3] -> buffer [1, 3], mean 2, pop std 1 -> [-1/(1+1e-6), 0, 1/(1+1e-6)]
    adv = tr.update(["a", "a", "a"], t64([1, NAN, 3]))
    assert_close(adv, [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)])
    assert list(tr.stats["a"]) == [1.0, 3.0]


def test_stat_tracker_keeps_dtype():
    tr = PerPromptStatTracker(buffer_size=8, min_count=1)
    adv = tr.update(["a", "a"], torch.tensor([0.0, 2.0], dtype=torch.float32))
    assert adv.dtype == torch.float32
    assert_close(adv, [-1 / (1 + 1e-6), 1 / (1 + 1e-6)])


# ----------------------------------------------------------------------------- GAE
def test_gae_by_hand():
    r = t64([[0, 0, 1], [0, 0, 1]])
    v = t64([[0.5, 0.6, 0.7], [0.5, 0.6, 0.7]])
    m = torch.ones(2, 3)
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t = [0.5, 0.4, 0.3]; returns = [1, 1, 1]
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    assert_close(adv, [[0.5, 0.4, 0.3]] * 2)
    assert_close(ret, [[1.0, 1.0, 1.0]] * 2)
    # gamma = lam = 0.5:
    # t=2: delta = 1 + 0 - 0.7 = 0.3;           A2 = 0.3
    # t=1: delta = 0 + 0.5*0.7 - 0.6 = -0.25;   A1 = -0.25 + 0.25*0.3 = -0.175
    # t=0: delta = 0 + 0.5*0.6 - 0.5 = -0.2;    A0 = -0.2 + 0.25*(-0.175) = -0.24375
    adv, ret = gae(r, v, m, gamma=0.5, lam=0.5)
    assert_close(adv[0], [-0.24375, -0.175, 0.3])
    assert_close(ret[0], [-0.24375 + 0.5, -0.175 + 0.6, 0.3 + 0.7])


def test_gae_right_padding_by_hand():
    # row [r=1 at t=1, then padding]: episode ends at t=1, V beyond = 0 (the pad value 9 is ignored)
    # gamma=0.9, lam=0.5: t=1: delta = 1 - 0.2 = 0.8; t=0: delta = 0 + 0.9*0.2 - 0.1 = 0.08,
    # A0 = 0.08 + 0.45*0.8 = 0.44
    r = t64([[0, 1, 9, 9]])
    v = t64([[0.1, 0.2, 9, 9]])
    adv, ret = gae(r, v, t64([[1, 1, 0, 0]]), gamma=0.9, lam=0.5)
    assert_close(adv, [[0.44, 0.8, 0, 0]])
    assert_close(ret, [[0.54, 1.0, 0, 0]])


def test_gae_mask_with_hole_matches_python_loop():
    rng = np.random.default_rng(4)
    r, v = rng.normal(size=(3, 6)), rng.normal(size=(3, 6))
    m = np.array([[1, 1, 1, 1, 1, 1],     # full
                  [1, 1, 1, 1, 0, 0],     # right padded
                  [1, 1, 0, 1, 1, 0]])    # a hole (e.g. an observation / tool-output step) + padding
    adv, ret = gae(t64(r), t64(v), t64(m), gamma=0.97, lam=0.9)
    ea, er = np_gae(r, v, m, 0.97, 0.9)
    assert_close(adv, ea)
    assert_close(ret, er)
    assert not adv.requires_grad


def test_gae_no_gradient():
    v = torch.randn(2, 3, dtype=F64, requires_grad=True)
    adv, ret = gae(torch.randn(2, 3, dtype=F64), v, torch.ones(2, 3), 1.0, 0.95)
    assert not adv.requires_grad and not ret.requires_grad


# ----------------------------------------------------------------------------- whiten
def test_whiten_by_hand():
    # unmasked [1, 2, 3, 6]: mean 3, squared deviations 4+1+0+9 = 14, Bessel var 14/3
    x = t64([[1, 2, 100], [3, 6, -100]])
    m = t64([[1, 1, 0], [1, 1, 0]])
    d = math.sqrt(14 / 3 + 1e-8)
    assert_close(whiten(x, m), [[-2 / d, -1 / d, 0], [0, 3 / d, 0]])
    # shift_mean=False adds the mean back; masked entries are 0
    assert_close(whiten(x, m, shift_mean=False), [[-2 / d + 3, -1 / d + 3, 0], [3, 3 / d + 3, 0]])


def test_whiten_matches_numpy():
    rng = np.random.default_rng(5)
    x = rng.normal(3.0, 2.0, size=(4, 7))
    m = rng.random((4, 7)) < 0.6
    xs = x[m]
    z = (x - xs.mean()) / np.sqrt(xs.var(ddof=1) + 1e-8)
    assert_close(whiten(t64(x), torch.tensor(m)), np.where(m, z, 0.0))
    assert_close(whiten(t64(x), torch.tensor(m), shift_mean=False), np.where(m, z + xs.mean(), 0.0))


def test_whiten_degenerate_masks():
    x = t64([[1.0, 2.0]])
    assert_close(whiten(x, torch.zeros(1, 2)), [[0.0, 0.0]])       # nothing unmasked
    assert_close(whiten(x, t64([[1, 0]])), [[0.0, 0.0]])            # one entry: (x - mean) = 0
