"""Benchmark P11: forward-process image RL (AWM, DiffusionNFT) against Flow-GRPO and the ``grpo_image`` default
(GRPO on an SDE window of 3 steps) on the embedded SD3 world: the training seconds each needs to reach held-out
prompt fidelity 0.85, and where each ends.

Every run is ``scripts/grpo_image.py --model_name_or_path embedded-sd3`` with the method's flags and otherwise the
script's defaults (350 steps, 4 prompts x 16 images, held-out fidelity on 168 images every 10 steps), alone in a
fresh process, one torch thread; seeds 0, 1, 2. Time to the threshold = the summed ``step_seconds`` (sample, score,
update; held-out evaluations not counted) up to the first evaluation after step 0 at or above it. Rows: each
forward-process method against flow_grpo (target <= 0.25) and against the default (target <= 0.5), medians over
seeds with every seed in the notes; each method's final fidelity and gold (pixel quality) against the base model's.
``--quick``: 1 step on seed 0 and threshold 0 (every row runs; the numbers mean nothing).

A full run takes about an hour on 2 CPU cores (12 runs of 3-8 minutes), so ``python -m benchmarks.run`` runs it only
when asked (``--only P11`` or ``--long``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, error_row, row

METHODS = {
    "flow_grpo": ["--algorithm", "flow_grpo", "--sde_window_size", "0"],
    "default": [],
    "awm": ["--algorithm", "awm"],
    "nft": ["--algorithm", "nft"],
}
THRESHOLD = 0.85


def run_method(method: str, seed: int, quick: bool, out: Path) -> dict:
    """One training run in a fresh process; its held-out fidelity curve and training seconds from the final
    checkpoint's history."""
    args = ["--model_name_or_path", "embedded-sd3", "--seed", str(seed), "--report_to", "none", "--output_dir",
            str(out), *METHODS[method]]
    args += ["--max_steps", "1", "--eval_steps", "1", "--num_eval", "4"] if quick else ["--eval_steps", "10"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1")  # unialign: the installed (editable) package
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "grpo_image.py"), *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"{method} seed {seed} exited {proc.returncode}: {proc.stderr[-1500:]}")
    summary = json.loads((out / "summary.json").read_text())
    ckpt = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    history = json.loads((ckpt / "trainer_state.json").read_text())["history"]
    curve, spent = [], 0.0
    for h in history:
        spent += h.get("step_seconds", 0.0)
        if "eval/fidelity" in h:
            curve.append((h["step"], spent, h["eval/fidelity"]))
    return {"curve": curve, "fidelity_before": summary["fidelity_before"], "fidelity_after": summary["fidelity_after"],
            "gold_before": summary["gold_before"], "gold_after": summary["gold_after"],
            "train_seconds": spent}


def seconds_to(curve: list[tuple[int, float, float]], threshold: float) -> float | None:
    """Training seconds at the first evaluation after step 0 whose fidelity is >= ``threshold`` (None: never)."""
    return next((s for step, s, f in curve if step > 0 and f >= threshold), None)


def run(quick: bool = False) -> list[dict]:
    seeds, threshold = ((0,), 0.0) if quick else ((0, 1, 2), THRESHOLD)
    res: dict[str, list[dict]] = {m: [] for m in METHODS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in seeds:
                for method in METHODS:
                    res[method].append(run_method(method, seed, quick, Path(tmp) / f"{method}-{seed}"))
    except Exception as e:  # noqa: BLE001
        return [error_row("P11", "forward-process image RL", e)]
    reach = {m: [seconds_to(r["curve"], threshold) for r in rs] for m, rs in res.items()}

    def median(values):
        known = [v for v in values if v is not None]
        return statistics.median(known) if len(known) == len(values) else None  # a seed that never got there: none

    def seeds_note(method):
        return ", ".join("never" if v is None else f"{v:.0f} s" for v in reach[method])

    setting = (f"embedded-sd3, grpo_image defaults (350 steps, 4 x 16 images, eval every 10 steps on 168), seeds "
               f"{list(seeds)}, one thread, each run alone in a fresh process; seconds to held-out fidelity >= "
               f"{threshold} (training only), medians")
    rows = []
    for method in ("awm", "nft"):
        for base, target in (("flow_grpo", 0.25), ("default", 0.5)):
            rows.append(row(f"P11-{method}-vs-{base}", f"seconds to fidelity {threshold}: {method} vs {base}",
                            median(reach[method]), median(reach[base]), "s", "lower", target,
                            f"{setting}; {method}: {seeds_note(method)}; {base}: {seeds_note(base)}",
                            seconds={m: reach[m] for m in (method, base)}))
    for method, rs in res.items():
        finals = [r["fidelity_after"] for r in rs]
        rows.append(row(f"P11-{method}-final", f"held-out fidelity at the end ({method})", statistics.median(finals),
                        statistics.median(r["fidelity_before"] for r in rs), "frac", "higher", None,
                        f"{setting}; after / before per seed: " + ", ".join(
                            f"{r['fidelity_after']:.3f} / {r['fidelity_before']:.3f}" for r in rs)
                        + "; gold after / before: " + ", ".join(f"{r['gold_after']:.3f} / {r['gold_before']:.3f}"
                                                                for r in rs),
                        gold_after=[r["gold_after"] for r in rs], gold_before=[r["gold_before"] for r in rs],
                        curves=[r["curve"] for r in rs]))
    return rows


def side_by_side(grids: dict[str, Path], out: Path, rows: int = 2) -> Path:
    """The first ``rows`` rows of each held-out grid (``grid_*.png`` of ``unialign.image.grid.save_grid``: tiles
    with captions, 8 to a row), stacked under a label per grid, as one PNG."""
    from PIL import Image, ImageDraw

    images = {name: Image.open(path).convert("RGB") for name, path in grids.items()}
    width = max(im.width for im in images.values())

    def tile_height(im) -> int:  # a tile and its caption: save_grid's cell (width / 8) plus 11 px a line + 4
        cell = im.width // 8
        return next(im.height // n for n in range(1, im.height + 1)
                    if im.height % n == 0 and im.height // n - cell in (15, 26, 37, 48))

    crops = {name: im.crop((0, 0, im.width, min(im.height, rows * tile_height(im)))) for name, im in images.items()}
    label_h = 22
    canvas = Image.new("RGB", (width, sum(c.height + label_h for c in crops.values())), "white")
    y, draw = 0, ImageDraw.Draw(canvas)
    for name, crop in crops.items():
        draw.text((6, y + 4), name, fill="black")
        canvas.paste(crop, (0, y + label_h))
        y += crop.height + label_h
    out.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--figure":  # --figure OUT.png label=grid.png ...
        print(side_by_side(dict(arg.split("=", 1) for arg in sys.argv[3:]), Path(sys.argv[2])))
    else:
        print(json.dumps(run(quick="--quick" in sys.argv), indent=1, default=str))
