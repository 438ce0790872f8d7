"""unialign.text.logprob: the chunked, recomputing log-prob/entropy kernel against the materialised path.

Expected values come from ``naive_token_logprobs`` evaluated in float64 (itself checked against the
textbook formula written out here), so the float32 kernel is held to float32 tolerance of the exact
answer, not of another float32 computation.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import assert_close
from unialign.text.logprob import naive_token_logprobs, token_logprobs

F64 = torch.float64
B, T, H, V = 2, 6, 8, 37  # N = 12 rows


def make(dtype=torch.float32, bias=True, seed=0, device="cpu", scale=0.5):
    """Inputs with O(1) logits and mean-style upstream weights (r / N), as in a real loss: float32
    rounding then stays well inside the shared float32 tolerance for the exact answer."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=F64) * scale
    w = torch.randn(V, H, generator=g, dtype=F64) * scale
    b = torch.randn(V, generator=g, dtype=F64) if bias else None
    tok = torch.randint(0, V, (B, T), generator=g)
    r1 = torch.randn(B, T, generator=g, dtype=F64) / (B * T)
    r2 = torch.randn(B, T, generator=g, dtype=F64) / (B * T)

    def cast(x):
        return None if x is None else x.to(device=device, dtype=dtype).requires_grad_(True)

    return cast(h), cast(w), cast(b), tok.to(device), r1.to(device), r2.to(device)


def f64_leaf(x):
    return None if x is None else x.detach().to(F64).requires_grad_(True)


def run_both(h, w, b, tok, r1, r2, *, temperature, chunk_size, with_entropy, loss_terms=("logp", "ent")):
    """Values and grads (h, w, b) of ours on the given inputs, and of the naive path in float64."""
    results = []
    for fn, args in (
        (lambda *a, **k: token_logprobs(*a, chunk_size=chunk_size, **k), (h, w, tok, b)),
        (naive_token_logprobs, (f64_leaf(h), f64_leaf(w), tok, f64_leaf(b))),
    ):
        out = fn(*args, temperature=temperature, with_entropy=with_entropy)
        logp, ent = out if with_entropy else (out, None)
        loss = 0.0
        if "logp" in loss_terms:
            loss = loss + (logp.to(F64) * r1).sum()
        if "ent" in loss_terms and ent is not None:
            loss = loss + (ent.to(F64) * r2).sum()
        leaves = [x for x in args if isinstance(x, torch.Tensor) and x.is_floating_point()]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        results.append((logp, ent, grads))
    return results


# ----------------------------------------------------------------------------- the reference itself
def test_naive_matches_textbook_formula():
    h, w, b, tok, _, _ = make(F64)
    tau = 0.7
    logp, ent = naive_token_logprobs(h, w, tok, b, temperature=tau, with_entropy=True)
    hl, wl, bl, tl = h.tolist(), w.tolist(), b.tolist(), tok.tolist()
    exp_logp, exp_ent = [], []
    for i in range(B):
        for t in range(T):
            z = [(sum(hk * wk for hk, wk in zip(hl[i][t], wl[v])) + bl[v]) / tau for v in range(V)]
            m = max(z)
            lse = m + math.log(sum(math.exp(x - m) for x in z))
            exp_logp.append(z[tl[i][t]] - lse)
            exp_ent.append(-sum(math.exp(x - lse) * (x - lse) for x in z))
    assert_close(logp, exp_logp)
    assert_close(ent, exp_ent)


# ----------------------------------------------------------------------------- float32 vs exact
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [3, 5, 1024])  # divides N=12, does not, larger than N
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_grads_fp32(with_entropy, temperature, chunk_size, bias):
    h, w, b, tok, r1, r2 = make(torch.float32, bias=bias)
    (lp, en, gr), (lp0, en0, gr0) = run_both(
        h, w, b, tok, r1, r2, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
    )
    assert lp.dtype == torch.float32 and lp.shape == (B, T)
    assert_close(lp, lp0, torch.float32)
    if with_entropy:
        assert en.dtype == torch.float32 and en.shape == (B, T)
        assert_close(en, en0, torch.float32)
    assert len(gr) == (3 if bias else 2)
    for g, g0, x in zip(gr, gr0, (h, w, b)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(g, g0, torch.float32)


@pytest.mark.parametrize("chunk_size", [4, 7])
def test_gradient_through_entropy_alone(chunk_size):
    h, w, b, tok, r1, r2 = make(torch.float32)
    (lp, en, gr), (_, en0, gr0) = run_both(
        h, w, b, tok, r1, r2, temperature=0.7, chunk_size=chunk_size, with_entropy=True, loss_terms=("ent",)
    )
    assert_close(en, en0, torch.float32)
    for g, g0 in zip(gr, gr0):
        assert_close(g, g0, torch.float32)
    # loss = entropy.sum(), exactly as a user would write it
    out = token_logprobs(h, w, tok, b, temperature=0.7, chunk_size=chunk_size, with_entropy=True)
    gh, gw = torch.autograd.grad(out[1].sum(), (h, w))
    h0, w0 = f64_leaf(h), f64_leaf(w)
    ref = naive_token_logprobs(h0, w0, tok, b.detach().double(), temperature=0.7, with_entropy=True)
    gh0, gw0 = torch.autograd.grad(ref[1].sum(), (h0, w0))
    assert_close(gh, gh0, torch.float32)
    assert_close(gw, gw0, torch.float32)


def test_logp_grad_with_entropy_returned_but_unused():
    h, w, b, tok, r1, r2 = make(torch.float32)
    (_, _, gr), (_, _, gr0) = run_both(
        h, w, b, tok, r1, r2, temperature=1.0, chunk_size=5, with_entropy=True, loss_terms=("logp",)
    )
    for g, g0 in zip(gr, gr0):
        assert_close(g, g0, torch.float32)


@pytest.mark.parametrize("frozen", ["weight", "hidden", "bias"])
def test_partial_requires_grad(frozen):
    """Frozen lm_head (LoRA), frozen trunk, frozen bias: only the requested grads are formed."""
    h, w, b, tok, r1, r2 = make(torch.float32)
    {"weight": w, "hidden": h, "bias": b}[frozen].requires_grad_(False)
    logp, ent = token_logprobs(h, w, tok, b, temperature=0.7, chunk_size=5, with_entropy=True)
    leaves = [x for x in (h, w, b) if x.requires_grad]
    grads = torch.autograd.grad((logp.double() * r1).sum() + (ent.double() * r2).sum(), leaves)
    ref = [f64_leaf(x) if x.requires_grad else x.detach().double() for x in (h, w, b)]
    lp0, en0 = naive_token_logprobs(ref[0], ref[1], tok, ref[2], temperature=0.7, with_entropy=True)
    grads0 = torch.autograd.grad((lp0 * r1).sum() + (en0 * r2).sum(), [r for r in ref if r.requires_grad])
    assert len(grads) == 2
    for g, g0 in zip(grads, grads0):
        assert_close(g, g0, torch.float32)


def test_no_grad_fast_path_and_shapes():
    h, w, b, tok, _, _ = make(torch.float32)
    with torch.no_grad():
        logp, ent = token_logprobs(h, w, tok, b, chunk_size=5, with_entropy=True)
    assert logp.grad_fn is None and not logp.requires_grad and ent.grad_fn is None
    lp0, en0 = naive_token_logprobs(*(f64_leaf(x) for x in (h, w)), tok, f64_leaf(b), with_entropy=True)
    assert_close(logp, lp0, torch.float32)
    assert_close(ent, en0, torch.float32)
    # nothing requires grad -> no graph even with grad enabled; 1-D and 3-D leading shapes work
    hd, wd = h.detach(), w.detach()
    lp1 = token_logprobs(hd.reshape(B * T, H), wd, tok.reshape(-1), chunk_size=5)
    assert lp1.grad_fn is None and lp1.shape == (B * T,)
    lp3 = token_logprobs(hd.reshape(2, 3, 2, H), wd, tok.reshape(2, 3, 2), chunk_size=5)
    assert_close(lp3.reshape(-1), lp1)


def test_bad_inputs():
    h, w, b, tok, _, _ = make(torch.float32)
    with pytest.raises(ValueError):
        token_logprobs(h, w, tok, temperature=0.0)
    with pytest.raises(ValueError):
        token_logprobs(h, w[:, :-1], tok)
    with pytest.raises(ValueError):
        token_logprobs(h, w, tok[:, :-1])


# ----------------------------------------------------------------------------- bf16
@pytest.mark.parametrize("with_entropy", [False, True])
def test_bf16_against_float64(with_entropy):
    h, w, b, tok, r1, r2 = make(torch.bfloat16)
    (lp, en, gr), (lp0, en0, gr0) = run_both(
        h, w, b, tok, r1, r2, temperature=0.7, chunk_size=5, with_entropy=with_entropy
    )
    assert lp.dtype == torch.float32
    assert_close(lp, lp0, torch.bfloat16)
    if with_entropy:
        assert_close(en, en0, torch.bfloat16)
    for g, g0, x in zip(gr, gr0, (h, w, b)):
        assert g.dtype == torch.bfloat16 == x.dtype
        assert_close(g, g0, torch.bfloat16)


# ----------------------------------------------------------------------------- gradcheck
def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3, 4, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(7, 4, generator=g, dtype=F64, requires_grad=True)
    b = torch.randn(7, generator=g, dtype=F64, requires_grad=True)
    tok = torch.randint(0, 7, (2, 3), generator=g)

    def f(h, w, b):
        return token_logprobs(h, w, tok, b, temperature=0.7, chunk_size=4, with_entropy=True)

    assert torch.autograd.gradcheck(f, (h, w, b))
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, tok, chunk_size=2), (h, w))


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    h, w, b, tok, r1, r2 = make(dtype, device="cuda")
    (lp, en, gr), (lp0, en0, gr0) = run_both(h, w, b, tok, r1, r2, temperature=0.7, chunk_size=5, with_entropy=True)
    assert_close(lp, lp0, dtype)
    assert_close(en, en0, dtype)
    for g, g0 in zip(gr, gr0):
        assert g.device.type == "cuda" and g.dtype == dtype
        assert_close(g, g0, dtype)


# ----------------------------------------------------------------------------- fused tile math (CUDA path)
@pytest.fixture
def fused_eager(monkeypatch):
    """Route token_logprobs through the fused-tile functions (compiled on CUDA), run eagerly here."""
    from unialign.text import logprob

    monkeypatch.setitem(logprob._FUSED, "force_eager", True)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [5, 1024])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_tile_path_values_and_grads_fp32(fused_eager, with_entropy, temperature, chunk_size, bias):
    h, w, b, tok, r1, r2 = make(torch.float32, bias=bias)
    (lp, en, gr), (lp0, en0, gr0) = run_both(
        h, w, b, tok, r1, r2, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
    )
    assert_close(lp, lp0, torch.float32)
    if with_entropy:
        assert_close(en, en0, torch.float32)
    for g, g0, x in zip(gr, gr0, (h, w, b)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(g, g0, torch.float32)


def test_fused_tile_path_bf16_matches_eager_path(fused_eager, monkeypatch):
    """bf16 inputs: the fused path keeps the tile in bf16 (as the matmul writes it) and does the softmax
    maths in fp32 -- the same numbers as the eager path, which upcasts the same bf16 tile."""
    from unialign.text import logprob

    h, w, _, tok, r1, r2 = make(torch.bfloat16, bias=False)
    outs = []
    for force in (True, False):
        monkeypatch.setitem(logprob._FUSED, "force_eager", force)
        lp, en = token_logprobs(h, w, tok, chunk_size=5, with_entropy=True)
        grads = torch.autograd.grad((lp * r1.float()).sum() + (en * r2.float()).sum(), (h, w))
        outs.append((lp, en, grads))
    (lp, en, (gh, gw)), (lp0, en0, (gh0, gw0)) = outs
    assert_close(lp, lp0, torch.float32)
    assert_close(en, en0, torch.float32)
    assert_close(gh, gh0)  # bf16 tolerance: both round dL/dz to bf16 before the grad GEMMs
    assert_close(gw, gw0)


@pytest.mark.slow
def test_compiled_cpu_tiles_write_the_gradient_in_place_correctly(monkeypatch):
    """The compiled kernels (C++ via torch.compile on CPU; normally only for real-vocabulary tiles) on a
    small problem: values and gradients against float64, with several chunks and a partial last tile,
    so the in-place ``_tile_grad_`` and the reused workspace are exercised as the big models use them."""
    from unialign.text import logprob

    monkeypatch.setitem(logprob._FUSED, "cpu_min_elements", 1)
    monkeypatch.setitem(logprob._FUSED, "enabled", True)  # restored afterwards, even if compiling fails
    monkeypatch.setitem(logprob._FUSED, "compiled", {})
    h, w, _, tok, r1, r2 = make(torch.float32, bias=False)
    (lp, en, gr), (lp0, en0, gr0) = run_both(h, w, None, tok, r1, r2, temperature=0.7, chunk_size=5,
                                             with_entropy=True)
    if not logprob._FUSED["enabled"]:
        pytest.skip("no C++ compiler for torch.compile here")
    assert set(logprob._FUSED["compiled"]) == {"stats", "grad"}
    assert_close(lp, lp0, torch.float32)
    assert_close(en, en0, torch.float32)
    for g, g0 in zip(gr, gr0):
        assert_close(g, g0, torch.float32)
