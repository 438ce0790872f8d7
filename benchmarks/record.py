"""``benchmarks/results/``: the latest measurement of every row, one file per machine kind, and the history.

    python -m benchmarks.record RUN.json --kind cpu        # a run's rows replace the same rows of results/cpu.*
    python -m benchmarks.record $OUT/gpu_results.json --kind gpu_h200   # a lent GPU's run (benchmarks/gpu.sh)
    python -m benchmarks.record --history P2-tput          # every measurement of a row, oldest first
    python -m benchmarks.record --history cpu_full.json    # one old run's rows, as its table was

``python -m benchmarks.run --record`` calls ``record`` itself. Layout of ``results/``:

* ``KIND.json``: ``{"kind", "runs": {run: {"date", "machine": {...}, "command", "source", ...}}, "rows": [...]}``,
  the latest measurement of each row id (a suite row, ``common.row``) plus ``"run"``, ``"date"``, ``"machine"`` (a
  one-line description; the full one is in ``runs``) and ``"command"``; ``KIND.md``: the same as two tables.
* ``history.jsonl``: one JSON object a line, in the order they left the latest files: ``{"type": "run", "run",
  "kind", "date", "machine", "command", "source", ...}`` once per run, before its first row, then ``{"type": "row",
  "run", "source", "kind", "date", "machine", "command", "row": {...}}`` for each measurement a later run replaced,
  and for each row without a measurement (an error or a skipped row: kept, but it does not replace the last good
  number); ``{"type": "note", "source", "kind", "date", "text"}``: a hand-written results file kept verbatim.
  ``source``: the file the run was written to (for runs from before this layout: their old name in ``results/``).

A run in quick / tiny mode is refused: its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import ROOT, markdown_table

RESULTS = ROOT / "benchmarks" / "results"
HISTORY = "history.jsonl"
META = ("run", "date", "machine", "command")  # what a latest row carries beside the row itself


def machine_label(machine: dict) -> str:
    """One line for a ``common.machine_info()`` dict: the accelerator (if any) and the CPU."""
    if not machine:
        return "not recorded"
    if machine.get("label"):
        return machine["label"]
    cpu = f"{machine.get('cpu')}, {machine.get('affinity_cpus')} CPUs"
    if machine.get("torch_threads") is not None and not machine.get("cuda"):
        cpu += f", torch threads {machine['torch_threads']}"
    return f"{machine['cuda']} ({cpu})" if machine.get("cuda") else cpu


def load(kind: str, results: Path = RESULTS) -> dict:
    path = results / f"{kind}.json"
    return json.loads(path.read_text()) if path.exists() else {"kind": kind, "runs": {}, "rows": []}


def read_history(results: Path = RESULTS) -> list[dict]:
    path = results / HISTORY
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def append_history(entries: list[dict], results: Path = RESULTS) -> None:
    if entries:
        with open(results / HISTORY, "a") as f:
            for e in entries:
                f.write(json.dumps(e, default=str) + "\n")


def run_meta(run: dict, *, command: str | None = None, date: str | None = None, source: str | None = None,
             **extra) -> dict:
    """The description of one run: date, machine, command, source file and the run-level fields it has."""
    meta = {"date": date or run.get("date") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": run.get("machine") or {}, "command": command or run.get("command") or "not recorded",
            "source": source or "not recorded"}
    meta.update({k: run[k] for k in ("mode", "args", "seconds", "timings_s") if k in run})
    meta.update(extra)
    return meta


def _history_row(row: dict, run_id: str, meta: dict, kind: str) -> dict:
    return {"type": "row", "run": run_id, "source": meta["source"], "kind": kind, "date": meta["date"],
            "machine": machine_label(meta["machine"]), "command": meta["command"],
            "row": {k: v for k, v in row.items() if k not in META}}


def _history_run(run_id: str, meta: dict, kind: str) -> dict:
    return {"type": "run", "run": run_id, "kind": kind, **meta}


def to_history(run: dict, kind: str, run_id: str, results: Path = RESULTS, **meta_kw) -> None:
    """Put a whole run straight into the history (a run that is not the latest of any row)."""
    meta = run_meta(run, **meta_kw)
    append_history([_history_run(run_id, meta, kind)]
                   + [_history_row(r, run_id, meta, kind) for r in run["rows"]], results)


def record(run: dict, kind: str, *, run_id: str | None = None, results: Path = RESULTS, **meta_kw) -> dict:
    """Make ``run``'s measured rows the latest of ``results/KIND.*``; the rows they replace, and ``run``'s rows
    without a measurement, go to ``history.jsonl``. ``meta_kw``: ``command`` / ``date`` / ``source`` when ``run``
    does not carry them, and further run fields (e.g. ``date_source``). Returns the new latest dict."""
    if run.get("mode") == "quick" or (run.get("args") or {}).get("tiny"):
        raise ValueError("a quick / tiny run is a smoke test: its numbers are not recorded")
    results.mkdir(parents=True, exist_ok=True)
    meta = run_meta(run, **meta_kw)
    run_id = run_id or meta["date"]
    latest = load(kind, results)
    if run_id in latest["runs"]:
        raise ValueError(f"run {run_id!r} is already in {kind}.json")
    history = read_history(results)
    logged = {e["run"] for e in history if e.get("type") == "run"}
    measured = [r for r in run["rows"] if r.get("ours") is not None]
    new_ids = {r["id"] for r in measured}
    out: list[dict] = []

    def log_run(rid: str, m: dict) -> None:
        if rid not in logged:
            logged.add(rid)
            out.append(_history_run(rid, m, kind))

    for old in latest["rows"]:
        if old["id"] in new_ids:
            log_run(old["run"], latest["runs"][old["run"]])
            out.append(_history_row(old, old["run"], latest["runs"][old["run"]], kind))
    unmeasured = [r for r in run["rows"] if r.get("ours") is None]
    if unmeasured:
        log_run(run_id, meta)
        out += [_history_row(r, run_id, meta, kind) for r in unmeasured]
    append_history(out, results)

    tagged = {r["id"]: {**r, "run": run_id, "date": meta["date"], "machine": machine_label(meta["machine"]),
                        "command": meta["command"]} for r in measured}
    rows = [tagged.pop(r["id"]) if r["id"] in tagged else r for r in latest["rows"]] + list(tagged.values())
    runs = {**latest["runs"], run_id: meta}
    latest = {"kind": kind, "runs": {k: v for k, v in runs.items() if any(r["run"] == k for r in rows)}, "rows": rows}
    write(latest, results)
    return latest


def write(latest: dict, results: Path = RESULTS) -> None:
    kind = latest["kind"]
    (results / f"{kind}.json").write_text(json.dumps(latest, indent=1, default=str) + "\n")
    (results / f"{kind}.md").write_text(markdown(latest))


def markdown(latest: dict) -> str:
    lines = [f"# Latest results: {latest['kind']}", "",
             "The latest measurement of every row, each with the run that made it (`python -m benchmarks.record`; "
             f"older measurements: `{HISTORY}`, `python -m benchmarks.record --history ID`). Commands are recorded as "
             "they were run: before the benchmarks became a package a module ran as `benchmarks/NAME.py`, today as "
             "`python -m benchmarks.NAME` from the repository root.", "",
             "| run | date | machine | command | seconds |", "|---|---|---|---|---|"]
    for rid, m in latest["runs"].items():
        full = m.get("machine") or {}
        versions = ", ".join(f"{k} {full[k]}" for k in ("torch", "transformers", "trl", "diffusers", "peft") if k in full)
        lines.append(f"| {rid} | {m['date']} | {machine_label(full)}{'; ' + versions if versions else ''} | "
                     f"`{m['command']}` | {m.get('seconds', '-')} |")
    return "\n".join(lines) + "\n\n" + markdown_table(latest["rows"], extra=("date", "run"))


def history_table(key: str, results: Path = RESULTS) -> str:
    """The recorded measurements of row id ``key`` (the history's, then the latest files'), or the rows of the run
    ``key`` (a run id or its source file's name)."""
    def hit(row_id: str, run_id: str, source: str) -> bool:
        return key in (row_id, run_id, source, Path(source).name)

    rows = [{**e["row"], "date": e["date"], "run": e["run"]} for e in read_history(results)
            if e.get("type") == "row" and hit(e["row"].get("id"), e["run"], e["source"])]
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("runs"), dict) and "rows" in data:
            rows += [r for r in data["rows"] if hit(r["id"], r["run"], data["runs"][r["run"]]["source"])]
    if not rows:
        raise SystemExit(f"no row or run {key!r} in {results}")
    return markdown_table(rows, extra=("date", "run"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.record", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="a run's JSON (python -m benchmarks.run / benchmarks.gpu)")
    p.add_argument("--kind", help="machine kind, the latest file's name: cpu, gpu_h200, ...")
    p.add_argument("--command", default=None, help="the command that produced the run (default: the one it records)")
    p.add_argument("--date", default=None, help="when it ran (default: the date it records)")
    p.add_argument("--history", metavar="ID_OR_SOURCE", help="print every measurement of a row id, or a run's rows")
    a = p.parse_args(argv)
    if a.history:
        print(history_table(a.history))
        return
    if not a.run or not a.kind:
        p.error("give a run's JSON and --kind (or --history ID)")
    run = json.loads(Path(a.run).read_text())
    latest = record(run, a.kind, command=a.command, date=a.date, source=str(a.run))
    print(f"{RESULTS / (a.kind + '.json')}: {len(latest['rows'])} rows from {len(latest['runs'])} runs")


if __name__ == "__main__":
    main()
