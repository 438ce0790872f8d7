"""Benchmark P11: the image RL methods side by side on the embedded SD3 world -- the forward-process ones (AWM,
DiffusionNFT, DGPO), the 2026 trust regions on Flow-GRPO's SDE steps (GRPO-Guard, Flow-DPPO), Flow-GRPO and the
``grpo_image`` default (GRPO on an SDE window of 3 steps): the training seconds each needs to reach held-out prompt
fidelity 0.85, and where each ends on both fidelity readings (the shape verifier it trains on, and the independent
reader no reward sees: ``unialign.embedded.shape_reader``) and the gold score (pixel quality).

Every run is ``scripts/grpo_image.py --model_name_or_path embedded-sd3`` with the method's flags and otherwise the
script's defaults (350 steps, 4 prompts x 16 images, held-out fidelity on 168 images every 5 steps), in a fresh
process, one torch thread; seeds 0, 1, 2; ``jobs`` runs at a time (default 2 on a 2-core machine: every method
under the same sharing, interleaved by seed). Time to the threshold = the summed ``step_seconds`` (sample, score,
update; held-out evaluations not counted) up to the first evaluation after step 0 at or above it. Rows: each
forward-process method against flow_grpo (target <= 0.25; DGPO's paper claims ~20x) and against the default (target
<= 0.5); GRPO-Guard and Flow-DPPO against flow_grpo (target <= 1), also at 4 inner epochs per batch (``-4ep``: where
plain Flow-GRPO's clip stops bounding positive-advantage updates); medians over seeds with every seed in the notes;
each method's final fidelity (both readings) and gold against the base model's. ``--quick``: 1 step on seed 0 and
threshold 0 (every row runs; the numbers mean nothing).

A full run takes about 2 hours on 2 CPU cores (21 runs of 3-5 minutes and 9 four-epoch runs of 12-15, two at a time), so
``python -m benchmarks.run`` runs it only when asked (``--only P11`` or ``--long``).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import ROOT, error_row, row

FOUR_EPOCHS = ["--num_iterations", "4"]
METHODS = {
    "flow_grpo": ["--algorithm", "flow_grpo", "--sde_window_size", "0"],
    "default": [],
    "awm": ["--algorithm", "awm"],
    "nft": ["--algorithm", "nft"],
    "dgpo": ["--algorithm", "dgpo"],
    "grpo_guard": ["--algorithm", "grpo_guard", "--sde_window_size", "0"],
    "flow_dppo": ["--algorithm", "flow_dppo", "--sde_window_size", "0"],
    "flow_grpo-4ep": ["--algorithm", "flow_grpo", "--sde_window_size", "0", *FOUR_EPOCHS],
    "grpo_guard-4ep": ["--algorithm", "grpo_guard", "--sde_window_size", "0", *FOUR_EPOCHS],
    "flow_dppo-4ep": ["--algorithm", "flow_dppo", "--sde_window_size", "0", *FOUR_EPOCHS],
}
# (method, baseline, target ratio of their seconds to the threshold)
VERSUS = [(m, b, t) for m in ("awm", "nft", "dgpo") for b, t in (("flow_grpo", 0.25), ("default", 0.5))] + [
    ("grpo_guard", "flow_grpo", 1.0), ("flow_dppo", "flow_grpo", 1.0),
    ("grpo_guard-4ep", "flow_grpo-4ep", 1.0), ("flow_dppo-4ep", "flow_grpo-4ep", 1.0)]
THRESHOLD = 0.85
EVAL_STEPS = 5  # held-out evaluations every 5 steps: the fast methods cross 0.85 after 30-40 steps


def run_method(method: str, seed: int, quick: bool, out: Path) -> dict:
    """One training run in a fresh process; its held-out fidelity curves (both readings) and training seconds from
    the final checkpoint's history."""
    args = ["--model_name_or_path", "embedded-sd3", "--seed", str(seed), "--report_to", "none", "--output_dir",
            str(out), "--num_threads", "1", *METHODS[method]]
    args += ["--max_steps", "1", "--eval_steps", "1", "--num_eval", "4"] if quick else ["--eval_steps", str(EVAL_STEPS)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "grpo_image.py"), *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"{method} seed {seed} exited {proc.returncode}: {proc.stderr[-1500:]}")
    return read_run(out)


def read_run(out: Path) -> dict:
    """A finished run's numbers from its folder: ``summary.json`` and the history of its last checkpoint's
    ``trainer_state.json`` (or a ``trainer_state.json`` kept beside the summary)."""
    summary = json.loads((out / "summary.json").read_text())
    ckpts = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    state = ckpts[-1] / "trainer_state.json" if ckpts else out / "trainer_state.json"
    history = json.loads(state.read_text())["history"]
    curve, spent = [], 0.0
    for h in history:
        spent += h.get("step_seconds", 0.0)
        if "eval/fidelity" in h:
            curve.append((h["step"], spent, h["eval/fidelity"], h.get("eval/fidelity/reader")))
    keys = ("fidelity_before", "fidelity_after", "fidelity_reader_before", "fidelity_reader_after", "gold_before",
            "gold_after")
    return {"curve": curve, **{k: summary.get(k) for k in keys}, "train_seconds": spent,
            "step_ratios": summary.get("step_ratios")}


def seconds_to(curve: list[tuple], threshold: float) -> float | None:
    """Training seconds at the first evaluation after step 0 whose fidelity is >= ``threshold`` (None: never)."""
    return next((point[1] for point in curve if point[0] > 0 and point[2] >= threshold), None)


def run(quick: bool = False, jobs: int = 2, methods: tuple[str, ...] | None = None,
        results: Path | None = None, runs: Path | None = None, keep: Path | None = None) -> list[dict]:
    """The rows; ``methods``: a subset of ``METHODS`` (rows needing another are left out); ``results``: also write
    every run's numbers there (JSON), for the docs' figures; ``runs``: read finished runs from ``runs/<method>-<seed>``
    folders instead of running them (``read_run``); ``keep``: run into ``keep/<method>-<seed>`` (grids, ``final/``,
    for the docs' figures) instead of a temporary folder."""
    seeds, threshold = ((0,), 0.0) if quick else ((0, 1, 2), THRESHOLD)
    methods = tuple(methods or METHODS)
    try:
        if runs is not None:
            res = {m: [read_run(runs / f"{m}-{s}") for s in seeds] for m in methods}
        else:
            folder = contextlib.nullcontext(str(keep)) if keep is not None else tempfile.TemporaryDirectory()
            with folder as tmp, ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                futures = {(m, s): pool.submit(run_method, m, s, quick, Path(tmp) / f"{m}-{s}")
                           for s in seeds for m in methods}
                res = {m: [futures[(m, s)].result() for s in seeds] for m in methods}
    except Exception as e:  # noqa: BLE001
        return [error_row("P11", "image RL side by side", e)]
    return rows_of(res, seeds, threshold, jobs, results)


def rows_of(res: dict[str, list[dict]], seeds: tuple[int, ...], threshold: float, jobs: int,
            results: Path | None = None) -> list[dict]:
    """The rows of the runs ``res`` (method -> one ``read_run`` per seed)."""
    if results is not None:
        results.write_text(json.dumps(res, indent=1))
    reach = {m: [seconds_to(r["curve"], threshold) for r in rs] for m, rs in res.items()}

    def median(values):
        known = [v for v in values if v is not None]
        return statistics.median(known) if len(known) == len(values) else None  # a seed that never got there: none

    def seeds_note(method):
        return ", ".join("never" if v is None else f"{v:.0f} s" for v in reach[method])

    setting = (f"embedded-sd3, grpo_image defaults (350 steps, 4 x 16 images, eval every {EVAL_STEPS} steps on 168), seeds "
               f"{list(seeds)}, one thread, {jobs} runs at a time in fresh processes; seconds to held-out fidelity >= "
               f"{threshold} (training only), medians")
    rows = []
    for method, base, target in VERSUS:
        if method in res and base in res:
            rows.append(row(f"P11-{method}-vs-{base}", f"seconds to fidelity {threshold}: {method} vs {base}",
                            median(reach[method]), median(reach[base]), "s", "lower", target,
                            f"{setting}; {method}: {seeds_note(method)}; {base}: {seeds_note(base)}",
                            seconds={m: reach[m] for m in (method, base)}))

    def per_seed(rs, key):
        return ", ".join("n/a" if r[key] is None else f"{r[key]:.3f}" for r in rs)

    for method, rs in res.items():
        finals = [r["fidelity_after"] for r in rs]
        readers = [r["fidelity_reader_after"] for r in rs if r["fidelity_reader_after"] is not None]
        rows.append(row(f"P11-{method}-final", f"held-out fidelity at the end ({method})", statistics.median(finals),
                        statistics.median(r["fidelity_before"] for r in rs), "frac", "higher", None,
                        f"{setting}; verifier after per seed: {per_seed(rs, 'fidelity_after')} (before "
                        f"{per_seed(rs, 'fidelity_before')}); reader after: {per_seed(rs, 'fidelity_reader_after')} "
                        f"(before {per_seed(rs, 'fidelity_reader_before')}); gold after: {per_seed(rs, 'gold_after')} "
                        f"(before {per_seed(rs, 'gold_before')})",
                        reader_after=readers, reader_median=statistics.median(readers) if readers else None,
                        gold_after=[r["gold_after"] for r in rs], gold_before=[r["gold_before"] for r in rs],
                        curves=[r["curve"] for r in rs]))
    return rows


LABELS = {"flow_grpo": "Flow-GRPO (`--algorithm flow_grpo --sde_window_size 0`)",
          "default": "default (GRPO, SDE window 3)",
          "awm": "AWM (`--algorithm awm`, KL 0.03, trust term 1)",
          "nft": "DiffusionNFT (`--algorithm nft`: β 0.1, KL 0.03)",
          "dgpo": "DGPO (`--algorithm dgpo`: six pairs over 0.9 of the schedule, no clip)",
          "grpo_guard": "GRPO-Guard (`--algorithm grpo_guard --sde_window_size 0`)",
          "flow_dppo": "Flow-DPPO (`--algorithm flow_dppo --sde_window_size 0`)",
          "flow_grpo-4ep": "Flow-GRPO, 4 inner epochs (`--num_iterations 4`)",
          "grpo_guard-4ep": "GRPO-Guard, 4 inner epochs",
          "flow_dppo-4ep": "Flow-DPPO, 4 inner epochs"}


def markdown_table(res: dict[str, list[dict]], threshold: float = THRESHOLD) -> str:
    """The docs' table of ``res`` (method -> runs by seed): seconds to ``threshold`` per seed and their median's
    ratio to Flow-GRPO's (the same epochs), each reading's before -> after per seed, gold, training seconds."""
    def seeds(values, fmt):
        return " / ".join("never" if v is None else fmt.format(v) for v in values)

    def med(values):
        return statistics.median(values) if values and None not in values else None

    lines = ["| method | seconds to fidelity 0.85 (× Flow-GRPO) | verifier fidelity before → after | independent "
             "reader before → after | gold before → after | training s |", "|---|---|---|---|---|---|"]
    for method, rs in res.items():
        reach = [seconds_to(r["curve"], threshold) for r in rs]
        base = "flow_grpo-4ep" if method.endswith("-4ep") else "flow_grpo"
        ratio = (med(reach) / med([seconds_to(r["curve"], threshold) for r in res[base]])
                 if base in res and med(reach) is not None and med(
                     [seconds_to(r["curve"], threshold) for r in res[base]]) else None)
        lines.append(
            f"| {LABELS.get(method, method)} | {seeds(reach, '{:.0f}')}"
            + (f" ({ratio:.2f}×)" if ratio is not None and method != base else "") + " | "
            f"{rs[0]['fidelity_before']:.3f} → {seeds([r['fidelity_after'] for r in rs], '{:.3f}')} | "
            f"{rs[0]['fidelity_reader_before']:.3f} → {seeds([r['fidelity_reader_after'] for r in rs], '{:.3f}')} | "
            f"{rs[0]['gold_before']:.3f} → {seeds([r['gold_after'] for r in rs], '{:.3f}')} | "
            f"{min(r['train_seconds'] for r in rs):.0f}-{max(r['train_seconds'] for r in rs):.0f} |")
    return "\n".join(lines)


def curves_figure(res: dict[str, list[dict]], out: Path, threshold: float = THRESHOLD) -> Path:
    """Held-out fidelity against training seconds for every run of ``res`` (method -> runs by seed), the verifier's
    reading on the left and the independent reader's on the right; one colour per method, one line per seed, the
    threshold dashed. The one-epoch methods and the 4-epoch ones (``-4ep``) get a row each when both are there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [[m for m in res if not m.endswith("-4ep")], [m for m in res if m.endswith("-4ep")]]
    groups = [g for g in groups if g]
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4 * len(groups)), squeeze=False)
    for (ax_v, ax_r), methods in zip(axes, groups):
        for i, method in enumerate(methods):
            for j, r in enumerate(res[method]):
                seconds = [point[1] for point in r["curve"]]
                for ax, column in ((ax_v, 2), (ax_r, 3)):
                    ax.plot(seconds, [point[column] for point in r["curve"]], color=f"C{i}", linewidth=1.0,
                            alpha=0.8, label=method if j == 0 else None)
        for ax, reading in ((ax_v, "the verifier (trained on)"), (ax_r, "the independent reader (never trained on)")):
            ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8)
            ax.set_title(f"held-out fidelity, {reading}", fontsize=10)
            ax.set_xlabel("training seconds (evaluations not counted)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


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


def stock_pipeline_figure(finals: dict[str, Path], out: Path, n: int = 8, seed: int = 1234) -> Path:
    """The held-out prompts' first ``n`` through each method's ``final/`` loaded by the stock diffusers pipeline with
    its ``sampling.json`` (what a user gets from the run's load snippet), the same seed per prompt for every method;
    one row per method, each tile captioned with the verifier's and the independent reader's verdicts."""
    from diffusers import DiffusionPipeline

    from unialign.embedded import shapes_world
    from unialign.embedded.shape_reader import shipped_reader
    from unialign.embedded.shape_verifier import verify
    from unialign.image.grid import make_grid

    held_out = shapes_world.prompts("test")  # ordered by shape: every (len / n)-th mixes circles, squares, triangles
    prompts = [held_out[i * len(held_out) // n] for i in range(n)]
    images, captions = [], []
    for name, final in finals.items():
        pipe = DiffusionPipeline.from_pretrained(str(final), text_encoder_3=None, tokenizer_3=None)
        sampling = Path(final) / "sampling.json"  # a run's final/; the base model: the world's sampling defaults
        settings = json.loads(sampling.read_text()) if sampling.is_file() else dict(
            num_inference_steps=8, guidance_scale=1.0, height=shapes_world.IMAGE_SIZE, width=shapes_world.IMAGE_SIZE)
        row = [pipe(p, generator=__import__("torch").Generator().manual_seed(seed + i),
                    max_sequence_length=shapes_world.SD3_MAX_SEQUENCE_LENGTH, **settings).images[0]
               for i, p in enumerate(prompts)]
        verdict, reading = verify(prompts, row)["all"], shipped_reader().read(prompts, row)["all"]
        images += row
        captions += [f"{name.upper() + ': ' if i == 0 else ''}{p[2:].replace(' background', '')} | "
                     f"v:{'ok' if v > 0 else 'x'} r:{'ok' if r > 0 else 'x'}"
                     for i, (p, v, r) in enumerate(zip(prompts, verdict, reading))]
    out.parent.mkdir(parents=True, exist_ok=True)
    make_grid(images, captions, columns=n, cell=112).save(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--curves":  # --curves OUT.png results.json ...: fidelity over seconds
        print(curves_figure({m: rs for path in sys.argv[3:] for m, rs in json.loads(Path(path).read_text()).items()},
                            Path(sys.argv[2])))
    elif len(sys.argv) > 2 and sys.argv[1] == "--figure":  # --figure OUT.png label=grid.png ...
        print(side_by_side(dict(arg.split("=", 1) for arg in sys.argv[3:]), Path(sys.argv[2])))
    elif len(sys.argv) > 2 and sys.argv[1] == "--stock-figure":  # --stock-figure OUT.png label=run/final ...
        print(stock_pipeline_figure({k: Path(v) for k, v in (a.split("=", 1) for a in sys.argv[3:])}, Path(sys.argv[2])))
    else:
        only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--methods=")), None)
        out = next((Path(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--results=")), None)
        runs = next((Path(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--runs=")), None)
        keep = next((Path(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--keep=")), None)
        if "--table" in sys.argv:  # --table --runs=DIR [--methods=a,b]: the docs' table of finished runs
            names = only or [m for m in METHODS if (runs / f"{m}-0").is_dir()]
            have = {m: [read_run(runs / f"{m}-{s}") for s in (0, 1, 2) if (runs / f"{m}-{s}" / "summary.json").is_file()]
                    for m in names}
            print(markdown_table({m: rs for m, rs in have.items() if rs}))
        else:
            print(json.dumps(run(quick="--quick" in sys.argv, methods=only, results=out, runs=runs, keep=keep), indent=1,
                             default=str))
