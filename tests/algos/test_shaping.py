"""Reference-formula tests for unialign.algos.shaping: DAPO overlong penalty (Yu et al. 2025, eq. 13),
KL-in-reward shaping (Stiennon et al. 2020), adaptive KL controller (Ziegler et al. 2019)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import assert_close
from unialign.algos.shaping import AdaptiveKLController, kl_shaped_rewards, overlong_penalty

F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def test_overlong_penalty_by_hand():
    # L_max = 20, L_cache = 5 -> ramp starts after 15: ((15 - |y|) / 5)
    # 10 -> 0; 15 -> 0; 16 -> -0.2; 18 -> -0.6; 20 -> -1; 21 -> -1; 100 -> -1
    out = overlong_penalty(torch.tensor([10, 15, 16, 18, 20, 21, 100]), max_len=20, cache_len=5)
    assert out.dtype == torch.float32
    assert_close(out, [0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0])
    # cache_len == max_len: the ramp covers everything: |y| = 4 of 8 -> -0.5
    assert_close(overlong_penalty(torch.tensor([0, 4, 8, 9]), max_len=8, cache_len=8), [0.0, -0.5, -1.0, -1.0])


@pytest.mark.parametrize("max_len,cache_len", [(20, 0), (20, -1), (20, 21)])
def test_overlong_penalty_bad_arguments(max_len, cache_len):
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_len=max_len, cache_len=cache_len)


def np_kl_shaped(scores, kl, mask, coef):
    """r_t = -coef * KL_t on unmasked steps, + score at the last unmasked step (python loop)."""
    out = -coef * kl * mask
    for b in range(mask.shape[0]):
        steps = [t for t in range(mask.shape[1]) if mask[b, t]]
        if steps:
            out[b, steps[-1]] += scores[b]
    return out


def test_kl_shaped_rewards_by_hand():
    # coef 0.1; row 0 right padded (last step t=1); row 1 with a hole (last step t=3); row 2 empty
    kl = t64([[1.0, 2.0, 5.0, 5.0], [0.5, 9.0, 1.0, -1.0], [3.0, 3.0, 3.0, 3.0]])
    mask = t64([[1, 1, 0, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    scores = t64([10.0, -1.0, 7.0])
    out = kl_shaped_rewards(scores, kl, mask, kl_coef=0.1)
    # row 0: [-0.1, -0.2 + 10, 0, 0]; row 1: [-0.05, 0, -0.1, 0.1 - 1]; row 2: zeros (no score)
    assert_close(out, [[-0.1, 9.8, 0, 0], [-0.05, 0, -0.1, -0.9], [0, 0, 0, 0]])


def test_kl_shaped_rewards_matches_loop_and_detaches():
    rng = np.random.default_rng(0)
    kl_np, scores = rng.normal(size=(5, 7)), rng.normal(size=5)
    mask = (rng.random((5, 7)) < 0.6).astype(float)
    mask[0] = 0
    kl = t64(kl_np).requires_grad_()
    out = kl_shaped_rewards(t64(scores), kl, t64(mask), kl_coef=0.05)
    assert_close(out, np_kl_shaped(scores, kl_np, mask, 0.05))
    assert not out.requires_grad


def test_adaptive_kl_controller_by_hand():
    # Ziegler 2019: e = clip(KL/target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # KL 9: e = 0.5 -> 0.2; beta = 0.1 * (1 + 0.2 * 256/10000) = 0.1 * 1.00512
    assert_close(torch.tensor(c.update(9.0, 256), dtype=F64), 0.100512)
    # KL 3: e = -0.5 -> -0.2; beta = 0.100512 * (1 - 0.00512)
    assert_close(torch.tensor(c.update(3.0, 256), dtype=F64), 0.100512 * 0.99488)
    # KL 6.6: e = 0.1 (inside the clip); beta *= 1 + 0.1 * 100/10000 = 1.001
    assert_close(torch.tensor(c.update(6.6, 100), dtype=F64), 0.100512 * 0.99488 * 1.001)
    # state round trip
    d = AdaptiveKLController(1.0)
    d.load_state_dict(c.state_dict())
    assert_close(torch.tensor(d.update(6.0, 50), dtype=F64), 0.100512 * 0.99488 * 1.001)  # e = 0


def test_fixed_kl_controller():
    c = AdaptiveKLController(0.05)
    assert c.update(100.0, 1000) == 0.05
    assert c.value == 0.05
