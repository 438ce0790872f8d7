"""Reference-formula and invariance tests for unialign.algos.aggregate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_close
from unialign.algos.aggregate import aggregate, local_normalizer

F64 = torch.float64
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]  # row 2 is all masked


def np_aggregate(loss: np.ndarray, mask: np.ndarray, mode: str) -> float:
    """The four modes written from their definitions (verl core_algos.agg_loss; Dr.GRPO eq. 2)."""
    lm = loss * mask
    nonempty = mask.sum(1) > 0
    if mode == "token_mean":
        return lm.sum() / max(mask.sum(), 1)
    if mode == "seq_mean_token_mean":
        per = [lm[i].sum() / mask[i].sum() for i in range(len(mask)) if nonempty[i]]
        return sum(per) / max(len(per), 1)
    if mode == "seq_mean_token_sum":
        return lm.sum() / max(nonempty.sum(), 1)
    return lm.sum() / (mask.shape[0] * mask.shape[1])


@pytest.mark.parametrize(
    "mode,expected",
    [
        # unmasked values 1, 2 (row 0) and 4 (row 1); row 2 empty
        ("token_mean", 7 / 3),                    # (1 + 2 + 4) / 3 tokens
        ("seq_mean_token_mean", (1.5 + 4) / 2),   # ((1+2)/2 + 4/1) / 2 non-empty rows = 2.75
        ("seq_mean_token_sum", (3 + 4) / 2),      # ((1+2) + 4) / 2 non-empty rows = 3.5
        ("seq_mean_token_sum_norm", 7 / 9),       # (1 + 2 + 4) / (B=3 * T=3)
    ],
)
def test_modes_by_hand(mode, expected):
    out = aggregate(t64(LOSS), t64(MASK), mode)
    assert_close(out, expected)
    assert_close(out, np_aggregate(np.array(LOSS), np.array(MASK, dtype=float), mode))


@pytest.mark.parametrize(
    "alias,mode",
    [("dapo", "token_mean"), ("bnpo", "token_mean"), ("token-mean", "token_mean"),
     ("grpo", "seq_mean_token_mean"), ("seq-mean-token-mean", "seq_mean_token_mean"),
     ("seq-mean-token-sum", "seq_mean_token_sum"),
     ("dr_grpo", "seq_mean_token_sum_norm"), ("seq-mean-token-sum-norm", "seq_mean_token_sum_norm")],
)
def test_aliases(alias, mode):
    assert torch.equal(aggregate(t64(LOSS), t64(MASK), alias), aggregate(t64(LOSS), t64(MASK), mode))
    assert torch.equal(local_normalizer(t64(MASK), alias), local_normalizer(t64(MASK), mode))


def test_local_normalizer_by_hand():
    m = t64(MASK)
    assert_close(local_normalizer(m, "token_mean"), 3.0)               # unmasked steps
    assert_close(local_normalizer(m, "seq_mean_token_mean"), 2.0)      # non-empty rows
    assert_close(local_normalizer(m, "seq_mean_token_sum"), 2.0)
    assert_close(local_normalizer(m, "seq_mean_token_sum_norm"), 9.0)  # B * T
    assert_close(local_normalizer(m, "seq_mean_token_sum_norm", max_len=10), 30.0)


def test_explicit_normalizer():
    # sum of masked losses is 7; per-row token means 1.5 and 4
    assert_close(aggregate(t64(LOSS), t64(MASK), "token_mean", normalizer=14.0), 0.5)
    assert_close(aggregate(t64(LOSS), t64(MASK), "seq_mean_token_mean", normalizer=t64(11.0)), 5.5 / 11)


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_is_zero_not_nan(mode):
    loss = t64([[1.0, 2.0], [3.0, 4.0]]).requires_grad_()
    out = aggregate(loss, torch.zeros(2, 2), mode)
    out.backward()
    assert_close(out, 0.0)
    assert_close(loss.grad, np.zeros((2, 2)))


@pytest.mark.parametrize("mode", MODES)
def test_gradient_by_hand(mode):
    # dL/dloss_ij = mask_ij * weight: token_mean 1/3; seq_mean_token_mean 1/(2 |y_i|); seq_mean_token_sum 1/2;
    # sum_norm 1/9
    w = {"token_mean": [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0], [0, 0, 0]],
         "seq_mean_token_mean": [[1 / 4, 1 / 4, 0], [1 / 2, 0, 0], [0, 0, 0]],
         "seq_mean_token_sum": [[1 / 2, 1 / 2, 0], [1 / 2, 0, 0], [0, 0, 0]],
         "seq_mean_token_sum_norm": [[1 / 9, 1 / 9, 0], [1 / 9, 0, 0], [0, 0, 0]]}[mode]
    loss = t64(LOSS).requires_grad_()
    aggregate(loss, t64(MASK), mode).backward()
    assert_close(loss.grad, w)


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_row_is_ignored(mode):
    # an all-masked row adds nothing (and no NaN); only seq_mean_token_sum_norm's B * T_max counts it
    loss, mask = t64([[5.0, 7.0], [2.0, 3.0]]).requires_grad_(), t64([[0, 0], [1, 1]])
    out = aggregate(loss, mask, mode)
    out.backward()
    expected = {"token_mean": 2.5, "seq_mean_token_mean": 2.5, "seq_mean_token_sum": 5.0,
                "seq_mean_token_sum_norm": 5.0 / 4}[mode]
    assert_close(out, expected)
    assert_close(loss.grad[0], [0.0, 0.0])


def test_bad_mode_raises():
    with pytest.raises(ValueError):
        aggregate(t64(LOSS), t64(MASK), "mean")
    with pytest.raises(ValueError):
        local_normalizer(t64(MASK), "sum")


# ----------------------------------------------------------------------------- split invariance
def _split_sum(loss: torch.Tensor, mask: torch.Tensor, mode: str, cuts: list[int], procs: int, trim: bool):
    """Sum of aggregate over micro-batches with the global normaliser (divided by the number of
    simulated processes; each process sums its micro-batches, the processes' losses are averaged)."""
    T = mask.shape[1]
    bounds = [0, *cuts, mask.shape[0]]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        lb, mb = loss[a:b], mask[a:b]
        if trim:  # micro-batches re-padded to their own longest row (as a collator would)
            width = int(mb.sum(0).nonzero().max()) + 1 if mb.any() else 1
            lb, mb = lb[:, :width], mb[:, :width]
        parts.append((lb, mb))
    norm = sum(local_normalizer(mb, mode, max_len=T) for _, mb in parts) / procs
    per_proc = [torch.zeros((), dtype=loss.dtype) for _ in range(procs)]
    for k, (lb, mb) in enumerate(parts):
        per_proc[k % procs] = per_proc[k % procs] + aggregate(lb, mb, mode, normalizer=norm)
    return sum(per_proc) / procs


@settings(max_examples=50, deadline=None)
@given(
    data=st.data(),
    B=st.integers(2, 7),
    T=st.integers(1, 6),
    mode=st.sampled_from(MODES),
    procs=st.sampled_from([1, 2]),
    trim=st.booleans(),
)
def test_split_invariance(data, B, T, mode, procs, trim):
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T + 1, size=B)  # right padded, zero-length rows allowed
    mask = t64((np.arange(T)[None, :] < lengths[:, None]).astype(float))
    base = t64(rng.normal(size=(B, T)))
    n_cuts = data.draw(st.integers(0, B - 1))
    cuts = sorted(data.draw(st.lists(st.integers(1, B - 1), min_size=n_cuts, max_size=n_cuts, unique=True)))
    if procs == 2 and len(cuts) == 0:
        cuts = [B // 2]

    full_loss = base.clone().requires_grad_()
    full = aggregate(full_loss, mask, mode, normalizer=local_normalizer(mask, mode, max_len=T))
    full.backward()
    # the full batch agrees with the formula written out in numpy
    assert_close(full, np_aggregate(base.numpy(), mask.numpy(), mode))

    split_loss = base.clone().requires_grad_()
    split = _split_sum(split_loss, mask, mode, cuts, procs, trim)
    split.backward()
    assert_close(split, full)
    assert_close(split_loss.grad, full_loss.grad)
