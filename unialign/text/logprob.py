r"""Memory-lean per-token log-probabilities (and entropies) straight from the last hidden state.

Policy-gradient losses need, for every position ``(b, t)``,

.. math::

    z_{bt} = (h_{bt} W^\top + b) / \tau \in \mathbb{R}^V, \qquad
    \mathrm{lse}_{bt} = \log \sum_v e^{z_{btv}}, \qquad
    \log p_{bt} = z_{bt,y_{bt}} - \mathrm{lse}_{bt},

and often the entropy of the same softmax,
:math:`H_{bt} = -\sum_v p_v \log p_v = \mathrm{lse} - \sum_v p_v z_v`.

Shapes: ``hidden_B_T_H`` [..., H], ``weight_V_H`` [V, H] (the lm_head), ``bias_V`` [V] or None,
``tokens_B_T`` [...] (int64 ids, all valid: mask ignored positions *after* this call).
The results have the shape of ``tokens_B_T``.

Why not ``log_softmax(lm_head(h)).gather(...)``: the [B, T, V] logits dominate activation memory
(4 x 1024 x 151936 float32 = 2.5 GB per copy, and autograd keeps several copies: logits,
log-softmax, softmax for the entropy, ...). :func:`token_logprobs` never materialises them:

* forward: the B*T rows are processed in chunks of ``chunk_size`` rows; each chunk's logits are
  computed (matmul in the input dtype, softmax math in float32), reduced to ``lse``, the gathered
  logit and the entropy, and thrown away. One pass gives all three:
  with ``m = max z``, ``e = exp(z - m)``, ``s = sum e``: ``lse = m + log s`` and
  ``H = log s - sum(e * (z - m)) / s``.
* saved for backward: hidden, weight, bias, tokens and two float32 numbers per row (lse, H).
* backward recomputes the logits tile by tile and forms, with ``g`` / ``g_H`` the upstream grads,

  .. math::

      \frac{\partial L}{\partial (hW^\top + b)_v} = \frac{1}{\tau}\Big[
          g\,(\mathbb{1}[v = y] - p_v) \;-\; g_H\, p_v (\log p_v + H)\Big],

  then ``grad_hidden += G @ W_tile``, ``grad_W[tile] = G^T @ hidden``, ``grad_bias[tile] = sum_rows G``.
  The backward tiles run over the *vocabulary* (``tile = chunk_size * V / (B*T)`` columns, the same
  number of elements as a forward chunk): each ``grad_W`` row block is then produced by a single
  GEMM over all B*T rows (accumulated in float32 inside the GEMM, even for bf16 weights, without a
  float32 V x H buffer), and only the small [B*T, H] ``grad_hidden`` is accumulated across tiles
  (in float32 for low-precision inputs).

Cost: the recomputation adds one projection matmul to the three of a plain fwd+bwd, i.e. about
4/3 of the bare ``h @ W^T`` forward + backward, plus a few elementwise passes over each tile.
Peak extra memory is one tile workspace (``chunk_size * V`` elements), allocated once per call and
reused by every forward chunk and backward tile (the backward overwrites each tile's logits with its
dL/dz in place), instead of several [B*T, V] tensors. On CUDA (and on CPU for tiles of a real
vocabulary) the per-tile maths runs as one compiled kernel each way (``_tile_stats`` /
``_tile_grad_``: the tile stays in the matmul's dtype, the maths is float32 in registers: fewer passes over
memory than the eager elementwise ops, docs/benchmarks.md has the timings); ``UNIALIGN_FUSED_LOGPROB=0`` turns
it off.

Precision: matmuls run in the input dtype (bf16 on GPU is fine), their result is upcast to float32
(float64 inputs stay float64, so ``gradcheck`` works) before bias, temperature and the softmax math.
Outputs are float32 (float64 for float64 inputs); gradients come back in the inputs' dtypes.

:func:`naive_token_logprobs` is the straightforward reference (materialised logits) used by the
tests and as the baseline in ``benchmarks/logprob.py``.
"""

from __future__ import annotations

import os

import torch

__all__ = ["DEFAULT_CHUNK_SIZE", "naive_token_logprobs", "token_logprobs"]

# Rows per forward chunk (and elements per backward tile / V). Chosen by measurement
# (benchmarks/logprob.py on CPU): time is flat from 256 to 1024 rows, memory halves with each halving.
DEFAULT_CHUNK_SIZE = 512


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits(h, weight, bias, inv_t: float, acc: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """(h @ W^T + b) * inv_t in ``acc`` precision, as a tensor we may overwrite in place: ``out`` (a
    contiguous [rows, cols] buffer reused across tiles) when the matmul already runs in ``acc``."""
    if h.dtype == acc and (bias is None or bias.dtype == acc):
        if bias is not None:
            return torch.addmm(bias, h, weight.t(), beta=inv_t, alpha=inv_t, out=out)  # one fused pass
        z = torch.mm(h, weight.t(), out=out)
        return z.mul_(inv_t) if inv_t != 1.0 else z
    z = h @ weight.t()
    if z.dtype != acc:
        z = z.to(acc)
    if bias is not None:
        z.add_(bias)
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


def _tile_view(buf: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor | None:
    """A contiguous [rows, cols] view of the front of a flat workspace (None stays None).

    Every chunk / tile of one call writes into the same workspace: a fresh CPU tile of a real vocabulary
    (~300 MB) is mmap-ed and page-faulted on first touch at ~1 ns/element, which costs more than the
    softmax maths itself (benchmarks/logprob.py measures it)."""
    return None if buf is None else buf[: rows * cols].view(rows, cols)


# ---------------------------------------------------------------------------------------------
# Fused tile math: the eager ops above run several unfused elementwise passes over each fp32 tile (on a GPU
# most of the time; docs/benchmarks.md). These two functions hold the same
# math written for one fused kernel each (torch.compile -> Triton on CUDA, C++ on CPU for real-vocabulary
# tiles): the tile stays in the matmul's dtype in memory, the softmax math runs in float32 in registers;
# the gradient one overwrites its tile (the call's workspace) in place. Small CPU tiles keep the in-place
# eager path; tests run these functions eagerly against the naive reference, and compiled on CPU.
# ---------------------------------------------------------------------------------------------
_FUSED = {
    "enabled": os.environ.get("UNIALIGN_FUSED_LOGPROB", "1") != "0",
    "force_eager": False,  # tests: route through the fused functions without compiling
    # CPU compiles only tiles this large (a real vocabulary): compiling costs ~20 s per function on 2 cores,
    # which tiny models never amortise; measured on 2 cores, 512 x 151936 fp32: 187 ms eager -> 29 ms compiled
    "cpu_min_elements": 1 << 25,
    "compiled": {},
}


def _tile_stats(z, bias, tok, inv_t: float, with_entropy: bool):
    """z [R, V] raw logits h @ W^T (input dtype), bias [V] or None, tok [R] -> (logp, lse, ent) [R]."""
    zf = z.float()
    if bias is not None:
        zf = zf + bias.float()
    zf = zf * inv_t
    m = zf.amax(1, keepdim=True)
    e = torch.exp(zf - m)
    s = e.sum(1)
    log_s = s.log()
    lse = m.squeeze(1) + log_s
    logp = zf.gather(1, tok[:, None]).squeeze(1) - lse
    ent = log_s - (e * (zf - m)).sum(1) / s if with_entropy else None
    return logp, lse, ent


def _tile_grad_(z, bias, lse, a, c, gl, tok, v0: int, inv_t: float):
    """Overwrite a vocabulary tile of raw logits with dL/dz (see the module docstring), in place and in
    z's dtype: z [N, t] raw logits, lse / gl [N], a / c [N, 1] (c None without entropy), tok [N] global
    ids, v0 the tile's first id. In place so that the tile's memory is written once per call, not once
    per tile (a fresh 300 MB CPU tile costs ~1 ns/element in page faults, more than this maths)."""
    zf = z.float()
    if bias is not None:
        zf = zf + bias.float()
    logp = zf * inv_t - lse[:, None]
    p = torch.exp(logp)
    g = p * (a + c * logp) if c is not None else p * a
    cols = torch.arange(v0, v0 + z.shape[1], device=z.device)
    g = g + torch.where(cols[None, :] == tok[:, None], gl[:, None], 0.0)
    z.copy_(g)


def _fused_fn(name: str, h2: torch.Tensor, tile_elements: int):
    """The fused version of ``_tile_stats`` / ``_tile_grad_`` to use for ``h2``, or None (eager path):
    compiled on CUDA, and on CPU for tiles of at least ``cpu_min_elements``; eager when tests force it.
    ``UNIALIGN_FUSED_LOGPROB=0`` turns the compiled path off."""
    fn = {"stats": _tile_stats, "grad": _tile_grad_}[name]
    if _FUSED["force_eager"]:
        return fn
    big_cpu = h2.device.type == "cpu" and tile_elements >= _FUSED["cpu_min_elements"]
    if not (_FUSED["enabled"] and (h2.is_cuda or big_cpu) and h2.dtype != torch.float64):
        return None
    if name not in _FUSED["compiled"]:
        _FUSED["compiled"][name] = torch.compile(fn, dynamic=True)
    compiled = _FUSED["compiled"][name]

    def guarded(*args):
        try:
            return compiled(*args)
        except Exception as err:  # no Triton / compiler: the same math, eagerly, from now on
            import warnings

            _FUSED["enabled"] = False
            warnings.warn(f"fused log-prob kernels unavailable ({type(err).__name__}: {err}); using eager ops",
                          stacklevel=2)
            return fn(*args)

    return guarded


def _forward(h2, weight, bias, tok1, inv_t, chunk_size, with_entropy):
    """Chunked forward on flattened rows. Returns (logp, lse, entropy-or-None), all [N] in acc dtype."""
    n = h2.shape[0]
    acc = _acc_dtype(h2.dtype)
    logp = torch.empty(n, dtype=acc, device=h2.device)
    lse = torch.empty(n, dtype=acc, device=h2.device)
    ent = torch.empty(n, dtype=acc, device=h2.device) if with_entropy else None
    vocab = weight.shape[0]
    rows = min(chunk_size, n)
    stats = _fused_fn("stats", h2, rows * vocab)
    # one workspace for every chunk's logits (in the matmul's dtype: the fused kernel and the eager
    # full-precision path read it; low-precision eager upcasts into a fresh tensor anyway)
    ws = torch.empty(rows * vocab, dtype=h2.dtype, device=h2.device) if stats is not None or h2.dtype == acc else None
    for s in range(0, n, chunk_size):
        e_ = min(s + chunk_size, n)
        out = _tile_view(ws, e_ - s, vocab)
        if stats is not None:
            lp, ls, en = stats(torch.mm(h2[s:e_], weight.t(), out=out), bias, tok1[s:e_], inv_t, with_entropy)
            logp[s:e_], lse[s:e_] = lp, ls
            if with_entropy:
                ent[s:e_] = en
            continue
        z = _logits(h2[s:e_], weight, bias, inv_t, acc, out=out)
        z_tok = z.gather(1, tok1[s:e_, None]).squeeze(1)
        m = z.amax(1, keepdim=True)
        z.sub_(m)  # z <- z - m
        if with_entropy:
            ez = torch.exp(z)
            ssum = ez.sum(1)
            dot = torch.bmm(ez.unsqueeze(1), z.unsqueeze(2)).view(-1)  # sum e * (z - m), no temp
            del ez
            log_s = ssum.log()
            ent[s:e_] = log_s - dot / ssum
        else:
            log_s = z.exp_().sum(1).log()
        del z
        lse[s:e_] = m.squeeze(1) + log_s
        logp[s:e_] = z_tok - lse[s:e_]
    return logp, lse, ent


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h2, weight, bias, tok1, temperature, chunk_size, with_entropy):
        inv_t = 1.0 / temperature
        logp, lse, ent = _forward(h2, weight, bias, tok1, inv_t, chunk_size, with_entropy)
        ctx.save_for_backward(h2, weight, bias, tok1, lse, ent)
        ctx.inv_t = inv_t
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logp, ent
        return logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        h2, weight, bias, tok1, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None
        n, hdim = h2.shape
        vocab = weight.shape[0]
        acc = lse.dtype
        inv_t = ctx.inv_t
        dev = h2.device
        # Per-row coefficients: G = p * (a + c * log p) + onehot * gl, all pre-scaled by 1/tau.
        gl = (g_logp.to(acc) * inv_t) if g_logp is not None else torch.zeros(n, dtype=acc, device=dev)
        use_ent = g_ent is not None
        if use_ent:
            gh = g_ent.to(acc) * inv_t
            a = (-gl - gh * ent).unsqueeze(1)
            c = (-gh).unsqueeze(1)
        else:
            a = (-gl).unsqueeze(1)

        grad_h = grad_w = grad_b = None
        low_h = h2.dtype != acc
        if need_h:
            # float32 accumulator for low-precision hidden; otherwise accumulate into the result.
            grad_h = torch.zeros(n, hdim, dtype=acc, device=dev)
        if need_w:
            grad_w = torch.empty_like(weight)
        if need_b:
            grad_b = torch.empty(vocab, dtype=acc, device=dev)

        tile = max(1, min(vocab, (ctx.chunk_size * vocab) // max(n, 1)))
        lse_col = lse.unsqueeze(1)
        tok_col = tok1.unsqueeze(1)
        fused = _fused_fn("grad", h2, n * tile) if not need_b else None  # a bias gradient wants the fp32 tile
        # one workspace holds every tile's logits and then, overwritten in place, its dL/dz
        ws = torch.empty(n * tile, dtype=h2.dtype, device=dev) if fused is not None or not low_h else None
        aux = None  # eager entropy path: p = exp(log p) beside the tile
        for v0 in range(0, vocab, tile):
            v1 = min(v0 + tile, vocab)
            w_t = weight[v0:v1]
            b_t = bias[v0:v1] if bias is not None else None
            out = _tile_view(ws, n, v1 - v0)
            if fused is not None:
                gz = torch.mm(h2, w_t.t(), out=out)
                fused(gz, b_t, lse, a, c if use_ent else None, gl, tok1, v0, inv_t)
            else:
                z = _logits(h2, w_t, b_t, inv_t, acc, out=out)  # [N, tile]
                z.sub_(lse_col)  # log p
                if use_ent:
                    if aux is None:
                        aux = torch.empty(n * tile, dtype=acc, device=dev)
                    p = torch.exp(z, out=_tile_view(aux, n, v1 - v0))
                    z.mul_(c).add_(a).mul_(p)
                    del p
                else:
                    z.exp_().mul_(a)
                # one-hot term, only for targets inside this tile
                in_tile = (tok_col >= v0) & (tok_col < v1)
                idx = (tok_col - v0).clamp_(0, v1 - v0 - 1)
                z.scatter_add_(1, idx, torch.where(in_tile, gl.unsqueeze(1), 0.0))
                if need_b:
                    grad_b[v0:v1] = z.sum(0)
                gz = z if z.dtype == h2.dtype else z.to(h2.dtype)
                del z
            if need_w:
                torch.mm(gz.t(), h2, out=grad_w[v0:v1])
            if need_h:
                if low_h:
                    grad_h.add_(gz @ w_t)
                else:
                    grad_h.addmm_(gz, w_t)
            del gz
        if need_h and grad_h.dtype != h2.dtype:
            grad_h = grad_h.to(h2.dtype)
        if need_b and grad_b.dtype != bias.dtype:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def token_logprobs(
    hidden_B_T_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    tokens_B_T: torch.Tensor,
    bias_V: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
):
    """``log softmax((h @ W^T + b) / temperature)[token]`` (and the entropy of that softmax) without
    materialising the [B, T, V] logits. See the module docstring for the maths and the cost.

    Returns ``logp_B_T`` (float32; float64 for float64 inputs), or ``(logp_B_T, entropy_B_T)`` when
    ``with_entropy``. Differentiable w.r.t. hidden, weight and bias (any subset may require grad;
    with none, or under ``torch.no_grad()``, no autograd state is kept).
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    hdim = hidden_B_T_H.shape[-1]
    if weight_V_H.dim() != 2 or weight_V_H.shape[1] != hdim:
        raise ValueError(f"weight must be [V, {hdim}], got {tuple(weight_V_H.shape)}")
    if hidden_B_T_H.shape[:-1] != tokens_B_T.shape:
        raise ValueError(
            f"tokens {tuple(tokens_B_T.shape)} must match hidden's leading dims {tuple(hidden_B_T_H.shape[:-1])}"
        )
    out_shape = tokens_B_T.shape
    h2 = hidden_B_T_H.reshape(-1, hdim)
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    weight = weight_V_H if weight_V_H.is_contiguous() else weight_V_H.contiguous()
    if weight.dtype != h2.dtype:
        raise ValueError(f"hidden ({h2.dtype}) and weight ({weight.dtype}) dtypes differ")
    tok1 = tokens_B_T.reshape(-1).to(torch.long)

    needs_grad = torch.is_grad_enabled() and (
        h2.requires_grad or weight.requires_grad or (bias_V is not None and bias_V.requires_grad)
    )
    if needs_grad:
        out = _TokenLogprobs.apply(h2, weight, bias_V, tok1, float(temperature), int(chunk_size), with_entropy)
        if with_entropy:
            logp, ent = out
        else:
            logp, ent = out, None
    else:
        logp, _, ent = _forward(h2, weight, bias_V, tok1, 1.0 / temperature, int(chunk_size), with_entropy)
    if with_entropy:
        return logp.view(out_shape), ent.view(out_shape)
    return logp.view(out_shape)


def naive_token_logprobs(
    hidden_B_T_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    tokens_B_T: torch.Tensor,
    bias_V: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
):
    """Reference: materialise the logits, ``log_softmax`` -> ``gather``; entropy from the full softmax.
    Same signature and output dtypes as :func:`token_logprobs` (minus ``chunk_size``)."""
    logits = torch.nn.functional.linear(hidden_B_T_H, weight_V_H, bias_V)
    logits = logits.to(_acc_dtype(logits.dtype)) / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, tokens_B_T.to(torch.long).unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp
    entropy = -(logits.softmax(-1) * logp_all).sum(-1)
    return logp, entropy
