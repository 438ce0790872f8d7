"""Benchmark P1: per-token log-prob + entropy from the last hidden state, forward + backward.

Loss (all methods): ``logp.mean() + 0.01 * entropy.mean()``, gradients w.r.t. hidden and lm_head weight.

Methods
  (a) ours   ``unialign.text.logprob.token_logprobs(..., with_entropy=True)`` (chunked, recomputing)
  (b) trl    materialised logits -> ``trl.trainer.utils.selective_log_softmax`` + ``entropy_from_logits``
  (c) naive  materialised logits -> ``log_softmax`` -> ``gather``; entropy from the full softmax
  (d) floor  bare ``h @ W^T`` forward + backward with a random upstream gradient (pre-generated; it
             stands in for what any loss would hand back and is not counted)

Sizes (default = the issue's): B x T = 4 x 1024 rows, V = 151936, H = 896 (Qwen2.5-0.5B lm_head),
random float32 weights. On a small CPU box use ``--tokens`` to shrink T (the JSON records the sizes).

Time: median wall time of ``repeats`` fwd+bwd iterations, methods interleaved round-robin (so
background load hits all alike), after one warm-up round unless ``--no-warmup``; ``.grad`` is reset
to None before each iteration.

Activation memory: the peak, during fwd+bwd, of memory beyond what existed before the iteration
(parameters, inputs, the floor's upstream gradient) *and* beyond the leaf gradients alive at that
moment. Gradients appear part-way through backward, so the iteration is cut into segments at every
autograd node's pre-/post-hook, each segment's peak is read and reset, and only the gradients
already produced by the end of that segment are subtracted (see ``_Meter``).
  * CUDA: ``torch.cuda.max_memory_allocated`` / ``reset_peak_memory_stats`` (allocator-exact).
  * CPU: peak resident set size: ``VmHWM`` from /proc/self/status, reset to the current RSS by
    writing ``5`` to /proc/self/clear_refs (Linux >= 4.0). Torch's CPU allocator does not cache, and
    ``mallopt`` makes glibc mmap every block >= 256 KiB, so a tensor is resident exactly while it
    lives and the peak RSS growth is the peak tensor memory (page-granular, +/- small heap noise).
    Caveat for (a): its grad_W is allocated with ``empty`` and filled tile by tile, and untouched
    pages are not resident, so its CPU figure can read low by at most one grad_W tile
    (``chunk_size * V / (B*T) * H * itemsize`` bytes); ``ours_bytes_upper`` adds that bound.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from unialign.text.logprob import DEFAULT_CHUNK_SIZE, naive_token_logprobs, token_logprobs

ENT_COEF = 0.01


# ----------------------------------------------------------------------------- methods
def loss_ours(h, w, tok, chunk_size=DEFAULT_CHUNK_SIZE):
    logp, ent = token_logprobs(h, w, tok, chunk_size=chunk_size, with_entropy=True)
    return logp.mean() + ENT_COEF * ent.mean()


def loss_trl(h, w, tok):
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    logits = F.linear(h, w)
    logp = selective_log_softmax(logits, tok)
    ent = entropy_from_logits(logits)
    return logp.float().mean() + ENT_COEF * ent.float().mean()


def loss_naive(h, w, tok):
    logp, ent = naive_token_logprobs(h, w, tok, with_entropy=True)
    return logp.mean() + ENT_COEF * ent.mean()


def logits_floor(h, w, tok):
    """The floor: the bare ``h @ W^T``; its backward takes the pre-generated upstream gradient (``_iteration``)."""
    return F.linear(h, w)


# ----------------------------------------------------------------------------- memory meter
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+)", f.read(), re.M).group(1))


def _rss_tracks_tensors() -> None:
    """Make glibc serve every block >= 256 KiB with its own mmap and trim the heap eagerly, so a
    freed tensor leaves the resident set at once (glibc's default *dynamic* mmap threshold grows up
    to 32 MiB after frees, after which freed blocks can linger in the heap and skew RSS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # pragma: no cover - non-glibc
        return
    libc.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD (fixing it disables the dynamic threshold)
    libc.mallopt(-1, 1024 * 1024)  # M_TRIM_THRESHOLD


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Meter:
    """Peak memory of one fwd+bwd beyond what existed before it and beyond the leaf gradients.

    Gradients appear part-way through backward, so "peak minus grad bytes" would be wrong whenever the
    peak happens before they exist. Instead the iteration is cut into segments at every autograd node's
    pre- and post-hook; each segment's peak is read and reset, and from it we subtract only the leaf
    gradients already produced by the end of that segment (matched by storage pointer once backward is
    done). A node's outputs are alive at its post-hook, so a node that creates a leaf gradient has its
    peak with that gradient alive. Result: max over segments of (peak - base - grads alive).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.segments: list[tuple[int, frozenset]] = []
        self.seen: set[int] = set()
        self.handles = []
        if self.cuda:
            self.method = "cuda.max_memory_allocated, reset per autograd node"
        else:
            try:
                self._clear_refs()
                self.method = "VmHWM (peak RSS), reset via /proc/self/clear_refs per autograd node"
            except OSError as e:  # pragma: no cover - old kernels / restricted /proc
                raise RuntimeError("CPU memory measurement needs a writable /proc/self/clear_refs") from e

    def _clear_refs(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._clear_refs()

    def _peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kib("VmHWM") * 1024

    def start(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = _status_kib("VmRSS") * 1024
        self._reset()

    def boundary(self, produced=()):
        peak = self._peak()
        self.seen.update(_ptr(t) for t in produced if isinstance(t, torch.Tensor))
        self.segments.append((peak, frozenset(self.seen)))
        self._reset()

    def attach(self, root) -> None:
        """Hook every node reachable from ``root`` (call between forward and backward)."""
        self.boundary()  # end of the forward segment
        todo, visited = [root], set()
        while todo:
            node = todo.pop()
            if node is None or id(node) in visited:
                continue
            visited.add(id(node))
            self.handles.append(node.register_prehook(lambda go: self.boundary()))

            def post(gi, go, node=node):
                produced = list(gi)
                var = getattr(node, "variable", None)  # AccumulateGrad: the .grad it may have cloned
                if var is not None and var.grad is not None:
                    produced.append(var.grad)
                self.boundary(produced)

            self.handles.append(node.register_hook(post))
            todo.extend(nxt for nxt, _ in node.next_functions)

    def finish(self, leaves) -> int:
        self.boundary()
        for hd in self.handles:
            hd.remove()
        grads = {_ptr(x.grad): x.grad.numel() * x.grad.element_size() for x in leaves if x.grad is not None}
        return max(peak - self.base - sum(n for p, n in grads.items() if p in seen) for peak, seen in self.segments)


# ----------------------------------------------------------------------------- driver
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _iteration(name, fn, h, w, tok, upstream, device):
    """One fwd+bwd; returns (seconds, activation bytes, loss, meter method)."""
    h.grad = None
    w.grad = None
    gc.collect()
    _sync(device)
    meter = _Meter(device)
    meter.start()
    t0 = time.perf_counter()
    if name == "floor":
        out, grad, loss_val = fn(h, w, tok), upstream, None
    else:
        out = fn(h, w, tok)
        grad, loss_val = None, out.detach()
    meter.attach(out.grad_fn)
    out.backward(grad)
    _sync(device)
    dt = time.perf_counter() - t0
    del out
    act = meter.finish((h, w))
    return dt, act, (None if loss_val is None else float(loss_val)), meter.method


def run(repeats: int | dict = 3, *, device: str = "cpu", batch: int = 4, tokens: int = 1024, vocab: int = 151936,
        hidden: int = 896, dtype: str = "float32", chunk_size: int = DEFAULT_CHUNK_SIZE,
        methods=("ours", "trl", "naive", "floor"), warmup: bool = True, seed: int = 0,
        sweep_chunks=(), warmup_tokens: int | None = None) -> list[dict]:
    """Run P1 and return JSON-able rows: per-method rows, then "P1-time" and "P1-mem" summary rows
    (ours vs TRL and vs the floor), then optional "chunk-<n>" rows for ``sweep_chunks``. ``repeats``: timed
    iterations, one number for every method or ``{method: n}``; ``warmup_tokens``: the warm-up iteration on the
    first that many tokens only (first-call overheads do not depend on T; saves a full-size round)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        _rss_tracks_tensors()
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(dev, dt).requires_grad_(True)
    h = torch.randn(batch, tokens, hidden, generator=g).to(dev, dt).requires_grad_(True)
    tok = torch.randint(0, vocab, (batch, tokens), generator=g).to(dev)
    upstream = None
    if "floor" in methods:
        upstream = (torch.randn(batch, tokens, vocab, generator=g) / (batch * tokens)).to(dev, dt)
    sizes = {"B": batch, "T": tokens, "V": vocab, "H": hidden, "dtype": dtype, "device": str(dev),
             "threads": torch.get_num_threads(), "repeats": repeats, "chunk_size": chunk_size}
    fns = {"ours": lambda a, b, c: loss_ours(a, b, c, chunk_size), "trl": loss_trl, "naive": loss_naive,
           "floor": logits_floor}
    if warmup:  # first-call overheads (thread pools, MKL/cuBLAS handles, lazy imports)
        n = min(warmup_tokens or tokens, tokens)
        wh = h if n == tokens else h[:, :n].detach().clone().requires_grad_(True)
        wu = upstream if upstream is None or n == tokens else upstream[:, :n].contiguous()
        for m in methods:
            _iteration(m, fns[m], wh, w, tok[:, :n], wu, dev)
        del wh, wu
    counts = repeats if isinstance(repeats, dict) else {m: repeats for m in methods}
    raw = {m: [] for m in methods}
    for i in range(max(counts[m] for m in methods)):  # round-robin, so background load hits every method alike
        for m in methods:
            if i < counts[m]:
                raw[m].append(_iteration(m, fns[m], h, w, tok, upstream, dev))
    res, rows = {}, []
    for m in methods:
        times = [r[0] for r in raw[m]]
        res[m] = {"time_s": statistics.median(times), "times_s": times,
                  "act_mem_bytes": max(r[1] for r in raw[m]), "loss": raw[m][-1][2], "mem_method": raw[m][-1][3]}
        rows.append({"id": f"P1-{m}", **res[m], **sizes})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    def ratio(a, b, key):
        return res[a][key] / res[b][key] if a in res and b in res and res[b][key] else None

    if "ours" in res:
        rows.append({"id": "P1-time", "ours_s": res["ours"]["time_s"],
                     "baseline_trl_s": res.get("trl", {}).get("time_s"),
                     "naive_s": res.get("naive", {}).get("time_s"), "floor_s": res.get("floor", {}).get("time_s"),
                     "ratio": ratio("ours", "trl", "time_s"), "floor_ratio": ratio("ours", "floor", "time_s"),
                     "target_ratio": 1.0, "target_floor_ratio": 1.4,
                     "times_s": {m: res[m]["times_s"] for m in res}, **sizes})
        n_rows = batch * tokens
        tile_bound = 0 if dev.type == "cuda" else (
            max(1, min(vocab, chunk_size * vocab // n_rows)) * hidden * w.element_size())
        ours_up = res["ours"]["act_mem_bytes"] + tile_bound
        trl_b = res.get("trl", {}).get("act_mem_bytes")
        floor_b = res.get("floor", {}).get("act_mem_bytes")
        rows.append({"id": "P1-mem", "ours_bytes": res["ours"]["act_mem_bytes"], "ours_bytes_upper": ours_up,
                     "baseline_trl_bytes": trl_b,
                     "naive_bytes": res.get("naive", {}).get("act_mem_bytes"),
                     "floor_bytes": floor_b,
                     "ratio": ours_up / trl_b if trl_b else None,
                     "floor_ratio": ours_up / floor_b if floor_b else None,
                     "target_ratio": 1 / 8, "mem_method": res["ours"]["mem_method"], **sizes})
    for c in sweep_chunks:
        its = [_iteration("ours", lambda a, b, t, c=c: loss_ours(a, b, t, c), h, w, tok, None, dev)
               for _ in range(counts.get("ours", 1))]
        rows.append({"id": f"chunk-{c}", "time_s": statistics.median(r[0] for r in its),
                     "times_s": [r[0] for r in its], "act_mem_bytes": max(r[1] for r in its),
                     **{**sizes, "chunk_size": c}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024, help="T (shrink for a quick CPU run)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    p.add_argument("--methods", default="ours,trl,naive,floor")
    p.add_argument("--sweep-chunks", default="", help="comma-separated chunk sizes to time for ours")
    p.add_argument("--no-warmup", action="store_true")
    a = p.parse_args(argv)
    rows = run(a.repeats, device=a.device, batch=a.batch, tokens=a.tokens, vocab=a.vocab, hidden=a.hidden,
               dtype=a.dtype, chunk_size=a.chunk_size, methods=tuple(a.methods.split(",")),
               warmup=not a.no_warmup, sweep_chunks=tuple(int(c) for c in a.sweep_chunks.split(",") if c))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
