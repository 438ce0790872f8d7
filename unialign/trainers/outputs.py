"""What a run writes at the end and along the way, beside its checkpoints: ``final/`` and ``summary.json``
(``finish_run``), the PNG curves, images and tables for the trackers. Every file goes through
``unialign.files``' write policy."""

from __future__ import annotations

import html
import json
import math
import numbers
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from unialign.errors import UserError
from unialign.files import (
    fsync_tree,
    json_safe,
    refuse_link,
    replace_dir,
    temp_dir,
    umask_modes,
    write_json,
    write_with,
    writing,
)
from unialign.trainers.checkpoint import RUN_ID_RE, agreed, find_checkpoint, read_trainer_state
from unialign.trainers.launch import StopSignals
from unialign.trainers.rundir import claimed, release


def claimed_run_id(out: Path) -> str | None:
    """The run id this process holds ``out`` for, when it is one (it names temporary folders)."""
    held = claimed(out)
    run_id = held.run_id if held is not None else None
    return run_id if run_id and RUN_ID_RE.fullmatch(run_id) else None


def defaults_record(cfg: Any) -> dict[str, Any]:
    """What ``summary.json`` says of ``cfg``'s defaults: ``model_defaults`` (the model whose own measured defaults
    filled the fields nobody set, and those values: ``MODEL_DEFAULTS``) and ``trl_departures`` (where a default nobody
    set differs from TRL's: ``unialign.trl_compat.trl_departures``), each when there is any."""
    from unialign.config import origin
    from unialign.trl_compat import trl_departures

    record, out = origin(cfg), {}
    if record["model_defaults"]:
        out["model_defaults"] = {"model": record["model"], "values": record["model_defaults"]}
    departures = trl_departures(cfg, record)
    if departures:
        out["trl_departures"] = departures
    return out


def announce_defaults(acc, cfg: Any) -> None:
    """Print, once at the start of a run, the model's own defaults applied (one line) and each default nobody set
    that differs from TRL's (one line each: field, value, TRL's, why), as ``defaults_record`` records them."""
    record = defaults_record(cfg)
    if "model_defaults" in record:
        m = record["model_defaults"]
        acc.print(f"defaults for the model {m['model']!r} (measured on it; flags override): "
                  + ", ".join(f"{k}={v}" for k, v in m["values"].items()))
    trl = getattr(type(cfg), "TRL_CONFIG", "")
    for d in record.get("trl_departures", []):
        if d["field"] in record.get("model_defaults", {}).get("values", {}):
            continue  # on the line above
        acc.print(f"default differs from TRL's {trl}: {d['field']}={d['value']} (TRL: {d['trl']}): {d['why']}")


def finish_run(acc, cfg, summary: dict, save, counters: dict[str, int] | None = None) -> dict:
    """End of a script: ``save(<output_dir>/final)`` on every process (stock-loadable weights, written by the
    main process into a temporary folder renamed into place, so ``final/`` is never half written), then on the
    main process write ``summary.json`` (strict JSON) with the run's config added, the trainer's non-zero
    ``counters`` (samples whose reward errored and were skipped, non-finite rewards, skipped steps; by default
    those the run's last checkpoint recorded), and the
    settings a resume changed (``config_changes_on_resume``, from the run's last checkpoint) when there were any;
    print where the outputs are and the summary as JSON, and release the run's hold on the directory.

    A run in which every step was skipped (non-finite losses or gradients: ``counters["skipped_steps"]`` equal to
    ``summary["steps"]``) trained nothing: ``summary.json`` says so (``"trained": false``), ``final/`` is not
    written, and ``NothingTrainedError`` is raised (one line, exit status 2 from a script). SIGTERM / SIGINT during
    the final save let it finish, then exit with 128 + the signal and one line; a second one stops at once.
    Returns the summary."""
    out = Path(cfg.output_dir)
    ckpt = find_checkpoint(out, "latest", required=False, verbose=False)
    state = read_trainer_state(ckpt) if ckpt is not None else {}
    counters = (state.get("counters") or {}) if counters is None else counters  # the run's last checkpoint has them
    summary.update({k: v for k, v in counters.items() if v})  # e.g. reward_errors skipped, nonfinite rewards
    summary["config"] = {k: v for k, v in asdict(cfg).items() if v is not None}
    summary.update(defaults_record(cfg))
    if callable(getattr(cfg, "algo_spec", None)):  # the algorithm as run: preset + overrides, every knob resolved
        from unialign.registry import KNOBS

        spec = cfg.algo_spec()
        summary["algorithm_spec"] = {"name": spec.name, **{k: getattr(spec, k) for k in KNOBS}}
    if state.get("config_changes"):
        summary["config_changes_on_resume"] = state["config_changes"]
    steps, skipped = summary.get("steps", state.get("step")), counters.get("skipped_steps", 0)
    nothing = isinstance(steps, int) and steps > 0 and skipped >= steps
    if nothing:
        summary["trained"] = False
    last = f"the last checkpoint, {ckpt}, is whole" if ckpt is not None else "no checkpoint was written"
    with StopSignals("finishing the final save, then stopping",
                     second=f"final/ is not written ({last}: --resume_from_checkpoint latest writes it)",
                     log_dir=out) as stop:
        if not nothing:
            _save_final(acc, out, save, claimed_run_id(out))
        if acc.is_main_process:
            write_json(out / "summary.json", summary, f"the summary {out / 'summary.json'}")
            print_summary(acc, out, summary)
    release(out)
    if nothing:
        raise NothingTrainedError(
            f"nothing was trained: all {steps} steps were skipped (non-finite loss or gradient norm: look at the "
            f"rewards, the data and --learning_rate); final/ was not written, {out / 'summary.json'} records it")
    if stop.received:
        acc.print(f"stopped by {signal.Signals(stop.received).name} during the final save, after it finished: "
                  f"final/ and summary.json are in {out}", file=sys.stderr)
        raise SystemExit(128 + stop.received)
    return summary


class NothingTrainedError(UserError):
    """Every step of a run was skipped: no weight moved."""


def _save_final(acc, out: Path, save, run_id: str | None) -> None:
    """``save`` into a temporary folder (the same on every process), renamed to ``<out>/final`` by the main process."""
    final = out / "final"
    what = f"the final weights {final}"
    tmp = None
    if acc.is_main_process:
        refuse_link(final, what)
        tmp = temp_dir(final, run_id)  # a killed final save of this run left debris of that name: it goes first
    tmp = Path(agreed(acc, None if tmp is None else str(tmp)))
    with writing(tmp if acc.is_main_process else None, what):
        acc.wait_for_everyone()
        save(str(tmp))  # on every process: a sharded model is gathered; the main process writes
        acc.wait_for_everyone()
        if acc.is_main_process:
            if any(tmp.iterdir()):  # a saver may write nothing (tests, a frozen policy)
                umask_modes(tmp)  # safetensors writes 0600: final/ is for others to load too
                fsync_tree(tmp)
                replace_dir(tmp, final, what)
            else:
                tmp.rmdir()


def print_summary(acc, output_dir: str | Path, summary: dict) -> None:
    """Print the output folder and the summary (without its config and algorithm spec) as JSON, on the main process."""
    shown = json_safe({k: v for k, v in summary.items() if k not in ("config", "algorithm_spec")})
    acc.print(f"outputs in {Path(output_dir).resolve()} (final/ weights, summary.json, curves, checkpoints)")
    acc.print(json.dumps(shown, indent=1))


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing moving average of ``values`` over ``window`` points (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def step_ratio_summary(history: list[dict], start: int = 0) -> dict[str, dict[str, float]]:
    """The per-step ratio diagnostics of ``history`` (``steps/<stat>/<t>``, ``unialign.algos.diagnostics``) averaged
    over the logged training steps from the ``start``-th entry on: {t: {stat: mean}} ({} when none were logged)."""
    sums: dict[str, dict[str, list[float]]] = {}
    for h in history[start:]:
        for key, value in h.items():
            if key.startswith("steps/") and isinstance(value, (int, float)) and math.isfinite(value):
                _, stat, t = key.split("/")
                sums.setdefault(t, {}).setdefault(stat, []).append(float(value))
    return {t: {stat: sum(v) / len(v) for stat, v in stats.items()} for t, stats in sorted(sums.items())}


def save_step_ratios(history: list[dict], path: str | Path) -> bool:
    """``path``: the importance ratio per denoising step (mean with a +-std band) and the clip / dropped fraction per
    step, for the first and the second half of training (GRPO-Guard's left shift, a trust region's activity). False
    (nothing written) when the history holds no per-step statistics."""
    half = len(history) // 2
    parts = [("first half", step_ratio_summary(history[:half])), ("second half", step_ratio_summary(history, half))]
    parts = [(label, s) for label, s in parts if s]
    if not parts:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_f) = plt.subplots(1, 2, figsize=(10, 3.5))
    for i, (label, summary) in enumerate(parts):
        ts = sorted(summary, key=int)
        x = [int(t) for t in ts]
        mean = [summary[t]["ratio_mean"] - 1.0 for t in ts]
        std = [summary[t].get("ratio_std", 0.0) for t in ts]
        ax_r.plot(x, mean, marker="o", color=f"C{i}", label=label)
        ax_r.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color=f"C{i}",
                          alpha=0.15)
        for j, stat in enumerate(sorted({k for t in ts for k in summary[t] if k.endswith("_frac")})):
            ax_f.plot(x, [summary[t].get(stat, math.nan) for t in ts], marker="os^"[j % 3], color=f"C{i}",
                      linestyle="-" if j == 0 else "--", label=f"{stat} ({label})")
    ax_r.axhline(0.0, color="grey", linewidth=0.8)
    ax_r.set_title("importance ratio - 1 per denoising step (mean, +-std)")
    ax_f.set_title("clipped / dropped fraction per step")
    for ax in (ax_r, ax_f):
        ax.set_xlabel("denoising step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save_figure(fig, path, f"the step ratios {path}")
    return True


def save_curves(history: list[dict], path: str | Path, keys: tuple[str, ...] = ("reward/mean",),
                smooth: tuple[str, ...] = ()) -> None:
    """Plot metrics over steps to a PNG (one panel per key present in the history, four to a row). Keys
    in ``smooth`` are drawn raw (faint) with a trailing moving average over ~5 % of the points on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def finite(key: str) -> list[tuple[int, float]]:
        return [(h["step"], float(h[key])) for h in history
                if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]

    keys = [k for k in keys if finite(k)]
    if not keys:
        return
    cols = min(len(keys), 4)
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, key in zip(axes.flat, keys):
        steps, values = zip(*finite(key))
        window = max(1, len(values) // 20)
        if key in smooth and window > 1:
            ax.plot(steps, values, color="C0", alpha=0.3, linewidth=0.8, label="raw")
            ax.plot(steps, smoothed(list(values), window), color="C0", label=f"mean of {window}")
            ax.legend(fontsize=8)
            ax.set_title(f"{key} (smoothed)")
        else:
            ax.plot(steps, values, marker="." if len(values) < 50 else None)
            ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    _save_figure(fig, path, f"the curves {path}")


def _save_figure(fig, path: str | Path, what: str) -> None:
    """``fig`` laid out and written to ``path`` through the write policy (``write_with``), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        write_with(path, lambda tmp: fig.savefig(tmp, dpi=100), what)
    finally:
        plt.close(fig)


def log_images(acc, images: dict[str, object], step: int) -> None:
    """Log PIL images / HWC uint8 arrays to the run's trackers that take images (TensorBoard, wandb);
    other trackers are skipped."""
    if not images:
        return
    import numpy as np

    for tracker in acc.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({k: np.asarray(v)[None] for k, v in images.items()}, step=step, dataformats="NHWC")
        elif hasattr(tracker, "log_images"):
            tracker.log_images({k: [v] for k, v in images.items()}, step=step)


# ------------------------------------------------------------------ the sample table
def json_line(row: dict[str, Any]) -> str:
    return json.dumps(row, allow_nan=False, ensure_ascii=False) + "\n"


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``completions.jsonl`` (objects with an integer ``step``); a missing file is no rows, and a
    line that is not such an object (one cut short by a crash) is skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.append(row)
    return out


def cell_text(value: Any) -> str:
    """A table cell as plain text: a string as it is, a number to 4 significant digits, ``None`` empty, a chat
    prompt (a list of ``{"role", "content"}`` messages) one ``role: content`` line per message, anything else
    as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f"{float(value):.4g}"
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(f"{m.get('role', '?')}: {cell_text(m['content'])}" for m in value)
    return json.dumps(json_safe(value), ensure_ascii=False)


_MARKDOWN_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_[]|"})


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """``rows`` (dicts; the columns are their keys, first-seen order) as a markdown table, the form TensorBoard's
    text dashboard renders: each cell is ``cell_text``, HTML-escaped, with markdown's emphasis / code / link /
    pipe characters escaped and line breaks as ``<br>``, so a completion shows as it was generated."""
    columns = list(dict.fromkeys(k for r in rows for k in r))

    def cell(value: Any) -> str:
        return html.escape(cell_text(value), quote=False).translate(_MARKDOWN_SPECIAL).replace("\n", "<br>")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def log_table(acc, name: str, rows: list[dict[str, Any]], step: int) -> None:
    """Log ``rows`` as one table named ``name`` to the run's trackers that show tables: TensorBoard gets a text
    summary (``markdown_table``, through the tracker's ``log`` with a string: ``add_text``), a tracker with
    ``log_table`` (wandb) a table of ``cell_text`` strings and numbers; other trackers are skipped, and no
    tracker's numeric log sees the table."""
    if not rows:
        return
    columns = list(dict.fromkeys(k for r in rows for k in r))
    for tracker in acc.trackers:
        if tracker.name == "tensorboard":
            tracker.log({name: markdown_table(rows)}, step=step)
        elif callable(getattr(tracker, "log_table", None)):
            data = [[v if isinstance(v, numbers.Real) or v is None else cell_text(v)
                     for v in (r.get(c) for c in columns)] for r in rows]
            tracker.log_table(name, columns=columns, data=data, step=step)
