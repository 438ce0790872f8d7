"""Benchmark P6: the math reward, ``unialign.rewards.math.math_accuracy_reward`` vs Hugging Face ``math-verify``.

Data: the labelled case set ``tests/rewards/data/math_cases.jsonl`` (GSM8K- and MATH-format completions with
their gold answers; each label decided by reading, not by running either library). Per library: agreement
with the labels (overall and per category), false positives (scored 1, labelled 0), and time per
completion (median, and per 1,000 completions) over ``repeats`` passes after a warm-up pass.

Ours is called once per completion (gold processed every call, as in training; the symbolic worker's
result cache is cleared before every pass, so repeated passes do not hit it). math-verify (optional:
``pip install math-verify``; the rows say so when it is missing) runs with its defaults as documented:
``verify(parse(gold), parse(completion))``, gold parsed on every call like TRL's ``accuracy_reward`` does.
A second math-verify column wraps a bare gold (no ``\\boxed``, no ``####``) in ``$...$`` first, the usual
workaround for MATH-500's ``answer`` column.

    .venv/bin/python -m benchmarks.math_reward [--quick] [--table]    # rows as JSON; --table: per-category md
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import error_row, row

CASES = Path(__file__).resolve().parents[1] / "tests" / "rewards" / "data" / "math_cases.jsonl"


def load_cases(path: Path = CASES) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ours_scorer():
    from unialign.rewards import math_worker
    from unialign.rewards.math import math_accuracy_reward

    def score(case: dict) -> float:
        return math_accuracy_reward([None], [case["completion"]], [case["gold"]])[0]

    def reset() -> None:
        math_worker.shared_worker()._cache.clear()

    return score, reset


def math_verify_scorer(wrap_bare_gold: bool = False):
    from math_verify import parse, verify

    def score(case: dict) -> float:
        gold = str(case["gold"])
        if wrap_bare_gold and "\\boxed" not in gold and "####" not in gold and "$" not in gold:
            gold = f"${gold}$"
        try:
            return float(verify(parse(gold), parse(case["completion"])))
        except Exception:  # noqa: BLE001 - a crash is a 0, as in TRL's accuracy_reward
            return 0.0

    return score, lambda: None


def evaluate(score, reset, cases: list[dict], repeats: int) -> dict:
    """Scores, agreement per category and per-completion times (seconds) of one scorer."""
    reset()
    for case in cases:  # warm-up: worker start-up, ANTLR tables, imports
        score(case)
    times: list[list[float]] = [[] for _ in cases]
    scores: list[float] = []
    for _ in range(repeats):
        reset()
        scores = []
        for i, case in enumerate(cases):
            t0 = time.perf_counter()
            scores.append(score(case))
            times[i].append(time.perf_counter() - t0)
    per_case = [min(t) for t in times]  # the least disturbed of the passes for each completion
    by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for case, s in zip(cases, scores):
        c = by_cat[case["category"]]
        c[0] += int(round(s) == case["label"])
        c[1] += 1
        c[2] += int(s >= 0.5 and case["label"] == 0)
    agree = sum(c[0] for c in by_cat.values())
    return {"agreement": agree / len(cases), "false_positives": sum(c[2] for c in by_cat.values()),
            "median_s": statistics.median(per_case), "per_1000_s": 1000 * sum(per_case) / len(cases),
            "categories": {k: {"agree": v[0], "n": v[1], "fp": v[2]} for k, v in sorted(by_cat.items())},
            "scores": scores}


def run(quick: bool = False) -> list[dict]:
    cases = load_cases()
    if quick:  # a smoke run on every 8th case (each category still in); agreement on the whole set is the row's meaning
        cases = cases[::8]
    repeats = 1 if quick else 3
    ours = evaluate(*ours_scorer(), cases, repeats)
    try:
        mv = evaluate(*math_verify_scorer(), cases, repeats)
        mv_wrapped = evaluate(*math_verify_scorer(wrap_bare_gold=True), cases, 1)
        mv_note = "math-verify 0.9 defaults: verify(parse(gold), parse(completion))"
    except ImportError as e:
        return [row("P6-agree", "agreement with labelled truth", ours["agreement"], None, "frac", "higher", None,
                    f"{len(cases)} labelled cases; math-verify not installed ({e}), no baseline",
                    categories=ours["categories"], false_positives=ours["false_positives"]),
                row("P6-time", "time per 1,000 completions", ours["per_1000_s"], None, "s", "lower", None,
                    f"median {ours['median_s'] * 1e3:.3f} ms per completion (target <= 2 ms)")]
    n = len(cases)
    common = f"{n} labelled cases (tests/rewards/data/math_cases.jsonl); {mv_note}"
    return [
        row("P6-agree", "agreement with labelled truth", ours["agreement"], mv["agreement"], "frac", "higher", 1.0,
            f"{common}; false positives: ours {ours['false_positives']}, math-verify {mv['false_positives']}; "
            f"math-verify with bare golds wrapped in $...$: {mv_wrapped['agreement']:.3f}",
            categories_ours=ours["categories"], categories_baseline=mv["categories"],
            categories_baseline_wrapped=mv_wrapped["categories"], false_positives_ours=ours["false_positives"],
            false_positives_baseline=mv["false_positives"], agreement_baseline_wrapped=mv_wrapped["agreement"]),
        row("P6-time", "time per 1,000 completions", ours["per_1000_s"], mv["per_1000_s"], "s", "lower", None,
            f"{common}; per completion min over {repeats} passes after a warm-up; median ours "
            f"{ours['median_s'] * 1e3:.3f} ms (target <= 2 ms), math-verify {mv['median_s'] * 1e3:.3f} ms",
            median_ours_s=ours["median_s"], median_baseline_s=mv["median_s"]),
    ]


def category_table(rows: list[dict]) -> str:
    agree = next(r for r in rows if r["id"] == "P6-agree")
    ours, mv = agree.get("categories_ours") or agree.get("categories"), agree.get("categories_baseline")
    wrapped = agree.get("categories_baseline_wrapped")
    lines = ["| category | cases | unialign | math-verify | math-verify (bare gold in $...$) |", "|---|---|---|---|---|"]
    for cat, o in ours.items():
        cells = [f"{o['agree'] / o['n']:.1%}" + (f" ({o['fp']} FP)" if o["fp"] else "")]
        for src in (mv, wrapped):
            c = (src or {}).get(cat)
            cells.append("-" if c is None else f"{c['agree'] / c['n']:.1%}" + (f" ({c['fp']} FP)" if c["fp"] else ""))
        lines.append(f"| {cat} | {o['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one timed pass instead of three")
    p.add_argument("--table", action="store_true", help="also print the per-category agreement table")
    a = p.parse_args(argv)
    try:
        rows = run(quick=a.quick)
    except Exception as e:  # noqa: BLE001
        rows = [error_row("P6", "math reward", e)]
    print(json.dumps(rows, indent=1, default=str))
    if a.table and ("categories_ours" in rows[0] or "categories" in rows[0]):
        print(category_table(rows))


if __name__ == "__main__":
    main()
