"""rollout_correction against an independent scalar restatement (plain Python floats, math.exp)."""

from __future__ import annotations

import math

import pytest
import torch

from unialign.algos import rollout_correction


def reference(old, roll, mask, level, mode, cap):
    """The definition, one element at a time."""
    B, T = len(old), len(old[0])
    weights, over = [[0.0] * T for _ in range(B)], [[False] * T for _ in range(B)]
    for b in range(B):
        seq = sum(old[b][t] - roll[b][t] for t in range(T) if mask[b][t])
        for t in range(T):
            if not mask[b][t]:
                continue
            log_r = (old[b][t] - roll[b][t]) if level == "token" else seq
            r = math.exp(log_r) if log_r < 700 else math.inf
            over[b][t] = r > cap
            weights[b][t] = min(r, cap) if mode == "truncate" else (r if r <= cap else 0.0)
    diffs = [abs(old[b][t] - roll[b][t]) for b in range(B) for t in range(T) if mask[b][t]]
    n = max(1, len(diffs))
    w_sum = sum(weights[b][t] for b in range(B) for t in range(T) if mask[b][t])
    metrics = {"mismatch_mean": sum(diffs) / n, "mismatch_max": max(diffs, default=0.0), "weight_mean": w_sum / n,
               "clipped_frac": sum(over[b][t] for b in range(B) for t in range(T) if mask[b][t]) / n}
    return weights, metrics


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("cap", [1.2, 2.0, 5.0])
def test_weights_and_metrics_equal_the_definition(level, mode, cap):
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(5, 9, generator=g, dtype=torch.float64) * 4
    roll = old + torch.randn(5, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 9, generator=g) > 0.25).double()
    mask[3] = 0  # an all-masked row
    w, m = rollout_correction(old, roll, mask, level=level, mode=mode, cap=cap)
    ref_w, ref_m = reference(old.tolist(), roll.tolist(), mask.tolist(), level, mode, cap)
    assert w.dtype == torch.float64
    assert torch.allclose(w, torch.tensor(ref_w, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    for k, v in ref_m.items():
        assert m[k].item() == pytest.approx(v, rel=1e-6, abs=1e-7), k
    # the caps bite somewhere in this data, so both branches are exercised
    assert 0 < ref_m["clipped_frac"] < 1 or level == "sequence"


def test_equal_log_probs_give_weight_one_and_the_loss_is_unchanged():
    old = torch.randn(3, 4) - 2
    mask = torch.ones(3, 4)
    w, m = rollout_correction(old, old.clone(), mask)
    assert torch.equal(w, torch.ones(3, 4)) and w.dtype == torch.float32
    assert m["mismatch_max"] == 0 and m["clipped_frac"] == 0 and m["weight_mean"] == 1


def test_weights_are_detached_and_finite_for_extreme_inputs():
    old = torch.tensor([[0.0, -1.0, -2.0], [-900.0, 0.0, 0.0]], requires_grad=True)
    roll = torch.tensor([[-900.0, -1.0, float("nan")], [0.0, float("-inf"), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            w, m = rollout_correction(old, roll, mask, level=level, mode=mode, cap=2.0)
            assert not w.requires_grad and torch.isfinite(w).all() and (w >= 0).all() and (w <= 2.0).all()
            assert all(torch.isfinite(v) for v in m.values())
    w, _ = rollout_correction(old, roll, mask, level="token", mode="truncate", cap=2.0)
    # exp(900) truncated to the cap; NaN engine log-prob -> 0; exp(-900) ~ 0; +inf ratio -> cap
    assert w[0, 0] == 2.0 and w[0, 1] == 1.0 and w[0, 2] == 0.0 and w[1, 0] == 0.0 and w[1, 1] == 2.0


def test_sequence_level_broadcasts_one_weight_per_sequence():
    old = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    roll = torch.tensor([[-1.2, -1.1, -0.9, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the masked token's huge gap is ignored
    w, _ = rollout_correction(old, roll, mask, level="sequence", mode="truncate", cap=10.0)
    expected = math.exp(0.2 + 0.1 - 0.1)
    assert torch.allclose(w, torch.tensor([[expected] * 3 + [0.0]]))


@pytest.mark.parametrize("kw, match", [({"level": "batch"}, "level"), ({"mode": "clip"}, "mode"),
                                       ({"cap": 0.0}, "cap"), ({"cap": float("inf")}, "cap")])
def test_bad_arguments_name_the_argument(kw, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        rollout_correction(x, x, torch.ones(1, 2), **kw)
    with pytest.raises(ValueError, match="shapes"):
        rollout_correction(x, torch.zeros(1, 3), torch.ones(1, 2))
