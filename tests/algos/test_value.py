"""Reference-formula tests for unialign.algos.value: PPO clipped value loss and entropy."""

from __future__ import annotations

import math

import numpy as np
import torch

from tests.helpers import assert_close
from unialign.algos.value import clipped_value_loss, entropy_from_logits

F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def test_clipped_value_loss_by_hand():
    # clip = 0.2
    # col 0: V=1.0, old=0.5, R=2.0: unclipped (1-2)^2 = 1; V_clip = 0.5 + 0.2 = 0.7, (0.7-2)^2 = 1.69
    #        -> 0.5 * 1.69 = 0.845 (clipped branch wins, gradient wrt V = 0)
    # col 1: V=1.0, old=0.5, R=0.0: unclipped 1; V_clip = 0.7 -> 0.49; max = 1 -> 0.5, gradient V - R = 1
    # col 2: V=0.6, old=0.5, R=0.0: in range, V_clip = V -> 0.5 * 0.36 = 0.18, gradient 0.6
    # col 3: masked -> 0
    values = t64([[1.0, 1.0, 0.6, 3.0]]).requires_grad_()
    old, ret, mask = t64([[0.5, 0.5, 0.5, 0.0]]), t64([[2.0, 0.0, 0.0, 9.0]]), t64([[1, 1, 1, 0]])
    loss, m = clipped_value_loss(values, old, ret, mask, clip=0.2)
    loss.sum().backward()
    assert_close(loss, [[0.845, 0.5, 0.18, 0.0]])
    assert_close(values.grad, [[0.0, 1.0, 0.6, 0.0]])
    # clipped branch strictly larger on 1 of the 3 unmasked steps
    assert_close(m["value_clip_frac"], 1 / 3)
    assert not m["value_clip_frac"].requires_grad


def test_clipped_value_loss_matches_numpy():
    rng = np.random.default_rng(0)
    v, old, ret = rng.normal(size=(4, 6)), rng.normal(size=(4, 6)), rng.normal(size=(4, 6))
    mask = (rng.random((4, 6)) < 0.7).astype(float)
    loss, m = clipped_value_loss(t64(v), t64(old), t64(ret), t64(mask), clip=0.3)
    v_clip = old + np.clip(v - old, -0.3, 0.3)
    l1, l2 = (v - ret) ** 2, (v_clip - ret) ** 2
    assert_close(loss, 0.5 * np.maximum(l1, l2) * mask)
    assert_close(m["value_clip_frac"], ((l2 > l1) * mask).sum() / mask.sum())


def test_no_clip():
    loss, m = clipped_value_loss(t64([[1.0, 2.0]]), t64([[0.0, 0.0]]), t64([[0.0, 5.0]]), t64([[1, 1]]), clip=None)
    assert_close(loss, [[0.5, 4.5]])  # 0.5 * 1^2, 0.5 * 3^2
    assert_close(m["value_clip_frac"], 0.0)


def test_all_masked_no_nan():
    loss, m = clipped_value_loss(t64([[1.0]]), t64([[0.0]]), t64([[3.0]]), t64([[0]]), clip=0.2)
    assert_close(loss, [[0.0]])
    assert_close(m["value_clip_frac"], 0.0)


def test_entropy_by_hand():
    # uniform over 4: log 4; logits [0, ln 3] -> p = [1/4, 3/4]: -(1/4 ln 1/4 + 3/4 ln 3/4)
    # near one-hot (logit gap 100): ~0
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e4, -1e4], [100.0, 0.0, 0.0, 0.0]])
    h = entropy_from_logits(logits)
    assert_close(h, [math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), 0.0])


def test_entropy_matches_numpy():
    rng = np.random.default_rng(1)
    z = rng.normal(0, 3, size=(2, 3, 11)).astype(np.float32)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    h = entropy_from_logits(torch.tensor(z))
    assert h.shape == (2, 3)
    assert_close(h, -(p * np.log(p)).sum(-1))
    # bf16 logits are computed in float32 and compared at float32 tolerance
    zb = torch.tensor(z).to(torch.bfloat16)
    zf = zb.float().numpy().astype(np.float64)
    pb = np.exp(zf - zf.max(-1, keepdims=True))
    pb /= pb.sum(-1, keepdims=True)
    assert_close(entropy_from_logits(zb), -(pb * np.log(pb)).sum(-1), dtype=torch.float32)
