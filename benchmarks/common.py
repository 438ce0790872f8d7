"""Shared helpers of the benchmark suite: machine description, RSS peaks, clean-peak subprocesses, rows.

Every comparison module exposes ``run(quick: bool) -> list[dict]``; each dict is a *row*:
``{"id", "measure", "ours", "baseline", "unit", "ratio", "target_ratio", "better", "notes", ...extras}``
with ``ratio = ours / baseline``. ``target_ratio`` is the bound the ratio must satisfy
(``<=`` when ``better == "lower"``, ``>=`` when ``better == "higher"``); ``None`` when informative only.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_MARK = "@@BENCH_RESULT@@"


# ----------------------------------------------------------------------------- machine
def machine_info() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu": _cpu_name(),
            "logical_cpus": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "mem_total_gib": _meminfo_gib("MemTotal")}
    for name in ("transformers", "trl", "diffusers", "peft", "accelerate"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001
            info[name] = f"unavailable ({type(e).__name__})"
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo_gib(key: str):
    try:
        with open("/proc/meminfo") as f:
            m = re.search(rf"^{key}:\s+(\d+)", f.read(), re.M)
        return round(int(m.group(1)) / 2**20, 1) if m else None
    except OSError:
        return None


# ----------------------------------------------------------------------------- memory
def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+)", f.read(), re.M).group(1))


def rss_bytes() -> int:
    return status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_tracks_tensors() -> None:
    """glibc: mmap every block >= 256 KiB and trim eagerly, so freed tensors leave the resident set
    (see benchmarks/logprob.py)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # pragma: no cover
        return
    libc.mallopt(-3, 256 * 1024)
    libc.mallopt(-1, 1024 * 1024)


def child_command(python, module: str, func: str, kwargs: dict, cpu: int | None = None) -> list[str]:
    """The command line that runs ``benchmarks.<module>.<func>(**kwargs)`` in a fresh ``python``
    (``python -m benchmarks.child``, to be started with ``cwd=ROOT``), pinned to core ``cpu`` when given."""
    return [str(python), "-m", "benchmarks.child", module, func, json.dumps(kwargs)] + ([str(cpu)] if cpu is not None else [])


def run_child(module: str, func: str, kwargs: dict, timeout: float = 900) -> dict:
    """Run ``benchmarks.<module>.<func>(**kwargs)`` in a fresh interpreter (clean RSS peak) and return
    the JSON it returns. Errors come back as ``{"error": ...}``."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(child_command(sys.executable, module, func, kwargs), cwd=str(ROOT), env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout}s"}
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith(RESULT_MARK):
            out = json.loads(line[len(RESULT_MARK):])
            out.setdefault("child_seconds", round(time.perf_counter() - t0, 1))
            return out
    return {"error": f"child exited {p.returncode}: " + (p.stderr or p.stdout)[-2000:]}


# ----------------------------------------------------------------------------- rows
def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def row(id: str, measure: str, ours, baseline, unit: str, better: str, target_ratio=None, notes: str = "",
        **extra) -> dict:
    ratio = (ours / baseline) if (isinstance(ours, (int, float)) and isinstance(baseline, (int, float))
                                  and baseline) else None
    met = None
    if ratio is not None and target_ratio is not None:
        met = ratio <= target_ratio if better == "lower" else ratio >= target_ratio
    return {"id": id, "measure": measure, "ours": ours, "baseline": baseline, "unit": unit, "ratio": ratio,
            "target_ratio": target_ratio, "better": better, "met": met, "notes": notes, **extra}


def error_row(id: str, measure: str, err: BaseException | str) -> dict:
    msg = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    tb = "" if isinstance(err, str) else traceback.format_exc()[-1500:]
    return {"id": id, "measure": measure, "ours": None, "baseline": None, "unit": None, "ratio": None,
            "target_ratio": None, "better": None, "met": None, "notes": f"ERROR {msg}", "traceback": tb}


def peak_memory_row(id: str, what: str, module: str, kwargs: dict, notes: str) -> dict:
    """``what``'s peak RSS over imports, ours against the baseline, each side alone in a fresh process
    (``module``'s ``memory_child(impl="ours" / "trl", **kwargs)``, whose ``peak_delta_bytes`` / ``peak_rss_bytes`` it
    reads); an error row naming both sides' errors when either failed. Informative: no target."""
    m = {impl: run_child(module, "memory_child", dict(impl=impl, **kwargs)) for impl in ("ours", "trl")}
    if any("error" in v for v in m.values()):
        return error_row(id, f"{what} peak RSS", "; ".join(v.get("error", "") for v in m.values()))
    return row(id, f"{what} peak RSS over imports", m["ours"]["peak_delta_bytes"], m["trl"]["peak_delta_bytes"],
               "bytes", "lower", None, notes, ours_peak_abs=m["ours"]["peak_rss_bytes"],
               baseline_peak_abs=m["trl"]["peak_rss_bytes"])


def fmt(v, unit: str | None = None) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if unit in ("bytes",):
            return f"{v / 2**20:.1f} MiB"
        if abs(v) >= 100:
            return f"{v:.1f}"
        if abs(v) >= 1:
            return f"{v:.3f}"
        return f"{v:.4g}"
    if isinstance(v, int) and unit == "bytes":
        return f"{v / 2**20:.1f} MiB"
    return str(v)


def markdown_table(rows: list[dict], extra: tuple[str, ...] = ()) -> str:
    """One line per row; ``extra``: keys of further columns, shown before the notes (e.g. ``("date",)``)."""
    lines = ["| id | measure | ours | baseline | ratio | target | met | " + "".join(f"{k} | " for k in extra) + "notes |",
             "|---|---|---|---|---|---|---|" + "---|" * len(extra) + "---|"]
    for r in rows:
        unit = r.get("unit")
        u = "" if unit in (None, "bytes") else f" {unit}"
        tgt = r.get("target_ratio")
        tgt_s = "-" if tgt is None else (f"<= {tgt:g}" if r.get("better") == "lower" else f">= {tgt:g}")
        met = {True: "yes", False: "NO", None: "-"}[r.get("met")]
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.3f}"
        notes = str(r.get("notes", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['id']} | {r.get('measure', '')} | {fmt(r.get('ours'), unit)}{u if r.get('ours') is not None else ''}"
                     f" | {fmt(r.get('baseline'), unit)}{u if r.get('baseline') is not None else ''} | {ratio} | {tgt_s}"
                     f" | {met} | " + "".join(f"{r.get(k, '-')} | " for k in extra) + f"{notes} |")
    return "\n".join(lines) + "\n"


def set_threads(n: int | None = None) -> int:
    import torch

    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
