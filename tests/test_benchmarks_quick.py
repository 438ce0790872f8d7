"""Benchmarks cannot silently break: every group of ``python -m benchmarks.run`` runs in ``--quick`` mode (shrunk sizes,
every row kept) and none returns an error row. The quick numbers are not compared with targets -- the sizes are
too small to mean anything -- only that each comparison still runs end to end against its baseline (TRL's
trainers, plain diffusers, math-verify, TRL 0.23 for P9, whose environment is built on first use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_benchmark_group_runs_quick_without_an_error_row(tmp_path):
    from benchmarks.run import MODULES

    out = tmp_path / "quick.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--output", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    errors = [f"{r['id']}: {r.get('notes', '')[-600:]}" for r in rows if r.get("error") or r.get("ours") is None]
    assert not errors, "benchmark rows failed:\n" + "\n".join(errors)
    groups = {r["id"].split("-")[0].rstrip("ab") for r in rows}
    assert groups == set(MODULES), f"groups without a row: {sorted(set(MODULES) - groups)}"
    assert result["mode"] == "quick"
    assert result["command"].startswith("python -m benchmarks.run --quick")


@pytest.mark.slow
def test_the_gpu_image_rl_rows_run_as_a_cpu_dry_run(tmp_path):
    """``python -m benchmarks.gpu --device cpu --tiny --only P11``: the forward-process and Flow-GRPO rows prepared for a
    lent GPU run their code paths end to end at tiny sizes, each a timed row without an error."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--tiny", "--only",
                           "P11", "--time-budget", "5000", "--output-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_results.json").read_text())["rows"]
    assert [r["id"] for r in rows] == ["G-P11-flow_grpo", "G-P11-awm", "G-P11-nft", "G-P11-dgpo", "G-P11-grpo_guard",
                                       "G-P11-flow_dppo"], rows
    assert all(r["ours"] and r["ours"] > 0 and r["collect_images_per_s"] > 0 for r in rows), rows


@pytest.mark.slow
def test_the_gpu_masked_diffusion_rows_run_as_a_cpu_dry_run(tmp_path):
    """``python -m benchmarks.gpu --device cpu --tiny --only P13``: the LLaDA-8B-sized rows' code paths (sampling and
    every estimator's forward + backward) at tiny sizes, each a timed row without an error."""
    from unialign.algos.masked_diffusion import LOG_PROB_ESTIMATORS

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--tiny", "--only", "P13",
                           "--time-budget", "5000", "--output-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_results.json").read_text())["rows"]
    assert [r["id"] for r in rows] == ["G-P13-sample", *(f"G-P13-{n}" for n in LOG_PROB_ESTIMATORS)], rows
    assert all(r["ours"] and r["ours"] > 0 for r in rows), rows


@pytest.mark.slow
def test_the_gpu_video_row_runs_as_a_cpu_dry_run(tmp_path):
    """``python -m benchmarks.gpu --device cpu --tiny --only P14``: the Wan 2.1 sampling row's code path (ours and the
    stock WanPipeline on the same modules) at tiny sizes, a timed row without an error (~10 s)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--tiny", "--only", "P14",
                           "--time-budget", "5000", "--output-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_results.json").read_text())["rows"]
    assert [r["id"] for r in rows] == ["G-P14a"] and rows[0]["ours"] > 0 and rows[0]["baseline"] > 0, rows
