"""``benchmarks`` as a package and ``benchmarks/results/`` as the latest run per row (``benchmarks.record``): no path
set-up in the package, every latest row with its date, machine and command, a history whose rows name their run,
and ``record`` moving a replaced measurement into the history. Fast: nothing is measured here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import record

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def test_the_package_sets_up_no_import_path():
    for path in sorted(BENCH.glob("*.py")) + [BENCH / "gpu.sh"]:
        text = path.read_text()
        assert "sys.path" not in text, path.name
        assert "PYTHONPATH=" not in text and "export PYTHONPATH" not in text, path.name


def test_running_a_module_as_a_file_says_how_to_run_it():
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "python -m benchmarks.run --quick" in proc.stderr


def _latest_files():
    for path in sorted(record.RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "runs" in data:
            yield path, data


def test_every_latest_row_names_its_run_date_machine_and_command():
    kinds = {path.stem for path, _ in _latest_files()}
    assert {"cpu", "gpu_h200"} <= kinds
    for path, latest in _latest_files():
        assert latest["kind"] == path.stem
        ids = [r["id"] for r in latest["rows"]]
        assert len(ids) == len(set(ids)), f"{path.name}: one row per id"
        for r in latest["rows"]:
            run = latest["runs"][r["run"]]
            assert r["date"] == run["date"] and r["command"] == run["command"] and r["command"]
            assert r["machine"] == record.machine_label(run["machine"]) and r["machine"] != "not recorded"
            assert r["ours"] is not None, f"{path.name}: {r['id']} holds no measurement"
        assert all(any(r["run"] == k for r in latest["rows"]) for k in latest["runs"]), "a run without rows"
        assert path.with_suffix(".md").read_text() == record.markdown(latest), f"{path.name}: .md out of date"


def test_the_history_rows_name_a_run_logged_before_them():
    seen = set()
    entries = record.read_history()
    assert entries
    for e in entries:
        assert e["type"] in ("run", "row", "note") and e["date"] and e["source"]
        if e["type"] == "run":
            seen.add(e["run"])
            assert e["command"] and "machine" in e
        elif e["type"] == "row":
            assert e["run"] in seen and e["row"]["id"]


def _run(rows, **kw):
    return {"machine": {"cpu": "test cpu", "affinity_cpus": 2, "torch_threads": 2}, "mode": "default",
            "rows": rows, **kw}


def _row(id_, ours):
    return {"id": id_, "measure": "m", "ours": ours, "baseline": 1.0, "unit": "s", "ratio": ours, "notes": ""}


def test_record_keeps_the_latest_per_row_and_moves_the_replaced_one_to_the_history(tmp_path):
    record.record(_run([_row("A", 1.0), _row("B", 2.0), _row("C", None)], command="first", date="d1"), "cpu",
                  results=tmp_path)
    latest = record.record(_run([_row("A", 3.0)], command="second", date="d2"), "cpu", results=tmp_path)
    assert [(r["id"], r["ours"], r["run"], r["command"]) for r in latest["rows"]] == [
        ("A", 3.0, "d2", "second"), ("B", 2.0, "d1", "first")]
    assert set(latest["runs"]) == {"d1", "d2"}
    history = record.read_history(tmp_path)
    assert [(e["type"], e.get("row", {}).get("id"), e["run"]) for e in history] == [
        ("run", None, "d1"), ("row", "C", "d1"), ("row", "A", "d1")]  # C: no measurement; A: replaced
    assert history[2]["row"]["ours"] == 1.0 and history[2]["command"] == "first"
    assert (tmp_path / "cpu.md").read_text() == record.markdown(latest)
    assert "| A |" in record.history_table("A", tmp_path) and "| B |" in record.history_table("d1", tmp_path)
    with pytest.raises(ValueError, match="smoke"):
        record.record(_run([_row("A", 1.0)], command="q", date="d3", mode="quick"), "cpu", results=tmp_path)
