"""Reference-formula tests for unialign.algos.policy_loss: PPO clip (Schulman et al. 2017, eq. 7),
DAPO clip-higher, dual clip (Ye et al. 2020; verl ``clip_ratio_c``), GSPO and GSPO-token (Zheng et al. 2025)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.helpers import assert_close
from unialign.algos.aggregate import aggregate
from unialign.algos.policy_loss import clipped_policy_loss, sequence_log_ratio

F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def np_ppo(ratio, adv, eps_low, eps_high, dual=None):
    """Elementwise L = max(-A rho, -A clip(rho, 1-eps_low, 1+eps_high)); for A < 0 with dual clip c:
    L = min(L, -c A) (verl)."""
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high))
    if dual is not None:
        loss = np.where(adv < 0, np.minimum(loss, -dual * adv), loss)
    return loss


def np_ppo_grad_wrt_logratio(ratio, adv, eps_low, eps_high, dual=None):
    """d L / d log rho: -A rho where the unclipped branch is active, 0 where clipped or dual-capped."""
    unclipped = -adv * ratio >= -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high)
    in_range = (ratio >= 1 - eps_low) & (ratio <= 1 + eps_high)
    active = unclipped | in_range
    g = np.where(active, -adv * ratio, 0.0)
    if dual is not None:
        capped = (adv < 0) & (np_ppo(ratio, adv, eps_low, eps_high) > -dual * adv)
        g = np.where(capped, 0.0, g)
    return g


def run(logratio, adv, mask=None, **kw):
    """clipped_policy_loss with old_logp = 0 so that log rho = logp; returns loss, grad wrt logp, metrics."""
    logp = t64(logratio).requires_grad_()
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp) if mask is None else t64(mask)
    loss, metrics = clipped_policy_loss(logp, old, t64(adv), mask, **kw)
    loss.sum().backward()
    return loss, logp.grad, metrics


# ----------------------------------------------------------------------------- token level, by hand
def test_ppo_clip_by_hand_both_signs_both_bounds():
    # eps = 0.2 (bounds 0.8, 1.2); one token per row, old_logp = 0 so rho = exp(logp)
    rho = np.array([1.5, 1.5, 0.5, 0.5, 1.1, 0.9])
    adv = np.array([1.0, -1.0, 1.0, -1.0, 2.0, -2.0])
    # rho=1.5, A=+1: max(-1.5, -1.2) = -1.2   clipped at the upper bound -> gradient 0
    # rho=1.5, A=-1: max( 1.5,  1.2) =  1.5   unclipped (pessimistic)    -> gradient -A rho = 1.5
    # rho=0.5, A=+1: max(-0.5, -0.8) = -0.5   unclipped                  -> gradient -0.5
    # rho=0.5, A=-1: max( 0.5,  0.8) =  0.8   clipped at the lower bound -> gradient 0
    # rho=1.1, A=+2: in range, -2.2                                      -> gradient -2.2
    # rho=0.9, A=-2: in range,  1.8                                      -> gradient  1.8
    loss, grad, m = run(np.log(rho)[:, None], adv, eps_low=0.2)
    assert_close(loss[:, 0], [-1.2, 1.5, -0.5, 0.8, -2.2, 1.8])
    assert_close(grad[:, 0], [0.0, 1.5, -0.5, 0.0, -2.2, 1.8])
    # clip_frac_low: rho < 0.8 with A < 0 -> row 3; clip_frac_high: rho > 1.2 with A > 0 -> row 0
    assert_close(m["clip_frac_low"], 1 / 6)
    assert_close(m["clip_frac_high"], 1 / 6)
    assert_close(m["clip_frac"], 2 / 6)
    assert_close(m["dual_clip_frac"], 0.0)
    assert_close(m["ratio_mean"], rho.mean())
    # approx_kl: mean of k3 of (old vs new) = (e^{-x} - 1) + x with x = log rho
    x = np.log(rho)
    assert_close(m["approx_kl"], np.mean(np.exp(-x) - 1 + x))


def test_asymmetric_bounds_by_hand():
    # DAPO clip-higher: eps_low = 0.2, eps_high = 0.28 -> bounds [0.8, 1.28]
    rho = np.array([1.25, 1.3, 0.79, 0.85])
    adv = np.array([1.0, 1.0, -1.0, -1.0])
    # 1.25 < 1.28, A>0: -1.25 (gradient -1.25); with symmetric 0.2 it would be clipped at -1.2
    # 1.30 > 1.28, A>0: -1.28 (clipped, gradient 0)
    # 0.79 < 0.80, A<0: max(0.79, 0.8) = 0.8 (clipped, gradient 0)
    # 0.85 in range, A<0: 0.85 (gradient 0.85)
    loss, grad, m = run(np.log(rho)[:, None], adv, eps_low=0.2, eps_high=0.28)
    assert_close(loss[:, 0], [-1.25, -1.28, 0.8, 0.85])
    assert_close(grad[:, 0], [-1.25, 0.0, 0.0, 0.85])
    assert_close(m["clip_frac_high"], 0.25)
    assert_close(m["clip_frac_low"], 0.25)


def test_dual_clip_by_hand():
    # c = 3, eps = 0.2, A = -1:
    # rho = 5: PPO loss max(5, 1.2) = 5 > c*|A| = 3 -> capped at 3, gradient 0
    # rho = 2: PPO loss 2 < 3 -> 2, gradient -A rho = 2
    # rho = 5, A = +1: dual clip never applies to A > 0 -> max(-5, -1.2) = -1.2 (clipped, gradient 0)
    # rho = 0.5, A = -2: max(1, 1.6) = 1.6 (< 6) -> 1.6, gradient 0 (lower clip)
    rho = np.array([5.0, 2.0, 5.0, 0.5])
    adv = np.array([-1.0, -1.0, 1.0, -2.0])
    loss, grad, m = run(np.log(rho)[:, None], adv, eps_low=0.2, dual_clip=3.0)
    assert_close(loss[:, 0], [3.0, 2.0, -1.2, 1.6])
    assert_close(grad[:, 0], [0.0, 2.0, 0.0, 0.0])
    assert_close(m["dual_clip_frac"], 0.25)


@pytest.mark.parametrize("eps_high,dual", [(None, None), (0.28, None), (0.28, 3.0), (None, 2.0)])
def test_token_level_matches_numpy(eps_high, dual):
    rng = np.random.default_rng(0)
    x = rng.normal(0, 0.5, size=(6, 7))
    adv = rng.normal(size=(6, 7))
    loss, grad, _ = run(x, adv, eps_low=0.2, eps_high=eps_high, dual_clip=dual)
    hi = 0.2 if eps_high is None else eps_high
    assert_close(loss, np_ppo(np.exp(x), adv, 0.2, hi, dual))
    assert_close(grad, np_ppo_grad_wrt_logratio(np.exp(x), adv, 0.2, hi, dual))


def test_ratio_exactly_one():
    # first on-policy update: logp == old_logp -> rho = 1, L = -A, dL/dlogp = -A, no clipping, approx_kl 0
    logp = t64([[-1.3, -0.2, -4.0], [-0.7, -2.2, -0.1]]).requires_grad_()
    adv = t64([0.5, -1.5])
    for level in ("token", "sequence", "sequence_token"):
        logp.grad = None
        loss, m = clipped_policy_loss(logp, logp.detach().clone(), adv, torch.ones(2, 3), 0.2, ratio_level=level)
        loss.sum().backward()
        assert_close(loss, [[-0.5] * 3, [1.5] * 3], msg=level)
        assert_close(m["ratio_mean"], 1.0)
        assert_close(m["approx_kl"], 0.0)
        assert_close(m["clip_frac"], 0.0)
        # token: d(-A rho)/dlogp = -A rho = -A. sequence: each token enters log s with weight 1/3 and the
        # row has 3 tokens of loss -A s, so again -A per token. sequence_token: -A sg[s] = -A.
        assert_close(logp.grad, [[-0.5] * 3, [1.5] * 3], msg=level)


def test_equal_bounds_is_symmetric_ppo():
    rng = np.random.default_rng(1)
    logp, old = t64(rng.normal(-1, 0.3, size=(5, 4))), t64(rng.normal(-1, 0.3, size=(5, 4)))
    adv, mask = t64(rng.normal(size=5)), torch.ones(5, 4)
    a, ma = clipped_policy_loss(logp, old, adv, mask, eps_low=0.2)
    b, mb = clipped_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert torch.equal(a, b)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_advantages_per_token_and_per_sequence_agree():
    rng = np.random.default_rng(2)
    logp, old = t64(rng.normal(size=(3, 4))), t64(rng.normal(size=(3, 4)))
    adv_B = t64(rng.normal(size=3))
    a, _ = clipped_policy_loss(logp, old, adv_B, torch.ones(3, 4), 0.2)
    b, _ = clipped_policy_loss(logp, old, adv_B[:, None].expand(3, 4), torch.ones(3, 4), 0.2)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- masking
def test_mask_and_all_masked_row():
    rng = np.random.default_rng(3)
    x = rng.normal(0, 0.4, size=(3, 4))
    adv = np.array([1.0, -1.0, 2.0])
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=float)
    for level in ("token", "sequence", "sequence_token"):
        loss, grad, m = run(x, adv, mask, eps_low=0.2, ratio_level=level, dual_clip=3.0)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        assert all(torch.isfinite(v).all() for v in m.values())
        assert_close(loss * t64(1 - mask), np.zeros((3, 4)))   # 0 at masked steps
        assert_close(grad[1], np.zeros(4))                      # all-masked row: no gradient
        assert_close(grad * t64(1 - mask), np.zeros((3, 4)))
    # metrics are means over unmasked steps only: token-level ratio_mean
    _, _, m = run(x, adv, mask, eps_low=0.2)
    assert_close(m["ratio_mean"], np.exp(x)[mask == 1].mean())


def test_everything_masked():
    loss, grad, m = run(np.zeros((2, 3)), np.array([1.0, -1.0]), np.zeros((2, 3)), eps_low=0.2)
    assert_close(loss, np.zeros((2, 3)))
    assert_close(grad, np.zeros((2, 3)))
    for k, v in m.items():
        assert_close(v, 0.0 * v, msg=k)


def test_bad_arguments():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        clipped_policy_loss(z, z, torch.zeros(1), z, 0.2, ratio_level="seq")
    with pytest.raises(ValueError):
        clipped_policy_loss(z, z, torch.zeros(1), z, 0.2, dual_clip=1.0)
    with pytest.raises(ValueError):
        clipped_policy_loss(z, z, torch.zeros(1), z, 0.2, dual_clip=0.5)


# ----------------------------------------------------------------------------- GSPO
def test_sequence_log_ratio_by_hand():
    # row 0: mask [1,1,0]: (0.3 + (-0.1)) / 2 = 0.1;  row 1: (0.2+0.4+0.6)/3 = 0.4;  row 2: all masked -> 0
    lr = t64([[0.3, -0.1, 9.0], [0.2, 0.4, 0.6], [5.0, 5.0, 5.0]])
    m = t64([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert_close(sequence_log_ratio(lr, m), [[0.1], [0.4], [0.0]])


def test_gspo_sequence_ratio_by_hand():
    # GSPO, eps_low = 3e-4, eps_high = 4e-4. Row 0: log-ratios [1e-4, 3e-4] -> log s = 2e-4, s = e^{2e-4}
    # (in range): L = -A s = -2 e^{2e-4} at both tokens. Row 1: [1e-3, 1e-3, pad] -> s = e^{1e-3} > 1.0004,
    # A = +1: clipped at -1.0004, gradient 0.
    # Row 0 has three tokens [1e-4, 3e-4, 2e-4]: mean 2e-4.
    x = np.array([[1e-4, 3e-4, 2e-4], [1e-3, 1e-3, 7.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0]], dtype=float)
    adv = np.array([2.0, 1.0])
    loss, grad, m = run(x, adv, mask, eps_low=3e-4, eps_high=4e-4, ratio_level="sequence")
    s0 = math.exp(2e-4)
    assert_close(loss, [[-2 * s0] * 3, [-1.0004, -1.0004, 0.0]])
    # d/dx_t of sum_t(-A s) over 3 tokens = 3 * (-A s) * (1/3) = -A s per token
    assert_close(grad, [[-2 * s0] * 3, [0.0, 0.0, 0.0]])
    assert_close(m["clip_frac_high"], 2 / 5)


def test_gspo_matches_numpy():
    rng = np.random.default_rng(4)
    B, T = 5, 6
    lp, old = rng.normal(-2, 0.5, size=(B, T)), rng.normal(-2, 0.5, size=(B, T))
    lp[:, :] = old + rng.normal(0, 2e-3, size=(B, T))  # small moves so some rows clip, some do not
    mask = (np.arange(T)[None, :] < rng.integers(1, T + 1, size=B)[:, None]).astype(float)
    adv = np.array([0.7, 1.25, -0.15, -0.16, 1.1])
    log_s = ((lp - old) * mask).sum(1) / mask.sum(1)
    # this seed gives s = [1.00109, 1.00010, 1.00023, 0.99696, 0.99961]: rows 0 (A>0, above 1+4e-4) and
    # 3 (A<0, below 1-3e-4) are clipped; rows 1, 2 are in range; row 4 is below 1-3e-4 with A>0 (unclipped)
    assert (log_s[0] > math.log(1.0004)) and (log_s[3] < math.log(0.9997)) and (log_s[4] < math.log(0.9997))
    assert (np.abs(np.exp(log_s[[1, 2]]) - 1) < 3e-4).all()
    logp = t64(lp).requires_grad_()
    loss, _ = clipped_policy_loss(logp, t64(old), t64(adv), t64(mask), 3e-4, 4e-4, ratio_level="sequence")
    total = aggregate(loss, t64(mask), "seq_mean_token_mean")
    total.backward()
    n = mask.sum(1)
    log_s = ((lp - old) * mask).sum(1) / n
    s = np.exp(log_s)
    per_row = np_ppo(s, adv, 3e-4, 4e-4)  # GSPO objective: mean over samples of the clipped sequence term
    assert_close(loss, per_row[:, None] * mask)
    assert_close(total, per_row.mean())
    # gradient: d/dlp_t = (1/B) * dL/dlog s * (1/|y|) on unmasked tokens
    g_row = np_ppo_grad_wrt_logratio(s, adv, 3e-4, 4e-4) / B / n
    assert_close(logp.grad, g_row[:, None] * mask)
    assert_close(logp.grad[[0, 3]], np.zeros((2, T)))  # clipped rows get no gradient at all


def test_gspo_with_one_step_is_token_level():
    rng = np.random.default_rng(5)
    lp, old, adv = t64(rng.normal(size=(6, 1))), t64(rng.normal(size=(6, 1))), t64(rng.normal(size=6))
    m = torch.ones(6, 1)
    tok, _ = clipped_policy_loss(lp, old, adv, m, 0.2, 0.3, dual_clip=3.0)
    for level in ("sequence", "sequence_token"):
        seq, _ = clipped_policy_loss(lp, old, adv, m, 0.2, 0.3, ratio_level=level, dual_clip=3.0)
        assert_close(seq, tok, msg=level)


def test_gspo_token_equals_gspo_in_value_with_per_token_gradient():
    rng = np.random.default_rng(6)
    B, T = 4, 5
    old = rng.normal(-1, 0.3, size=(B, T))
    lp = old + rng.normal(0, 3e-4, size=(B, T))
    lp[0] += 1e-3  # s_0 > 1 + 4e-4 and s_1 < 1 - 3e-4: tokens of these rows clip for one sign of A_t
    lp[1] -= 1e-3
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 1, 0]], dtype=float)
    adv = rng.normal(size=B)
    kw = dict(eps_low=3e-4, eps_high=4e-4)

    def loss_and_grad(level, a):
        logp = t64(lp).requires_grad_()
        loss, _ = clipped_policy_loss(logp, t64(old), t64(a), t64(mask), ratio_level=level, **kw)
        aggregate(loss, t64(mask), "seq_mean_token_mean").backward()
        return loss.detach(), logp.grad

    seq_l, seq_g = loss_and_grad("sequence", adv)
    tok_l, tok_g = loss_and_grad("sequence_token", adv)
    assert_close(tok_l, seq_l)               # same value
    assert_close(tok_g, seq_g)               # same gradient when the advantage is constant per sequence

    # per-token advantages: each token's gradient is its own -A_t * s_i / |y_i| / B (0 where clipped)
    adv_BT = rng.normal(size=(B, T))
    _, g = loss_and_grad("sequence_token", adv_BT)
    n = mask.sum(1, keepdims=True)
    s = np.exp(((lp - old) * mask).sum(1, keepdims=True) / n) * np.ones((1, T))
    expected = np_ppo_grad_wrt_logratio(s, adv_BT, 3e-4, 4e-4) / n / B * mask
    assert_close(g, expected)
    assert ((expected == 0) & (mask == 1)).any() and ((expected != 0) & (mask == 1)).any()


def test_garbage_at_masked_steps_never_becomes_nan():
    import math

    from unialign.algos import aggregate

    logp = torch.tensor([[-1.0, math.nan, 200.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.0, -300.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    for level in ("token", "sequence", "sequence_token"):
        loss, m = clipped_policy_loss(logp, old, torch.tensor([1.0]), mask, 0.2, ratio_level=level)
        total = aggregate(loss, mask, "token_mean")
        total.backward()
        assert torch.isfinite(total) and torch.isfinite(logp.grad).all(), level
        # only the unmasked step counts: rho = e^0.2 > 1.2 with A > 0 -> clipped at 1.2, zero gradient
        assert abs(float(total) + 1.2) < 1e-6 and float(m["clip_frac_high"]) == 1.0
        logp.grad = None
