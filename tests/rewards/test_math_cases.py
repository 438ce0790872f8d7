"""The math reward against the labelled case set (tests/rewards/data/math_cases.jsonl).

Each case is a realistic completion in GSM8K or MATH answer format with its gold answer and a label (1: the
completion's final answer is correct) decided by reading, not by running any library. Acceptance:
>= 93 % agreement in each format, at most 1 false positive per 500 cases. Speed (median <= 2 ms per completion)
is measured by benchmarks/math_reward.py (row P6), not by a timed test.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from unialign.rewards.math import math_accuracy_reward

CASES_PATH = Path(__file__).parent / "data" / "math_cases.jsonl"
CASES = [json.loads(line) for line in CASES_PATH.read_text().splitlines() if line.strip()]


def test_case_set_is_well_formed():
    assert len(CASES) >= 300
    assert len({c["id"] for c in CASES}) == len(CASES)
    for c in CASES:
        assert c["label"] in (0, 1) and c["style"] in ("gsm8k", "math") and c["category"], c
    per_category = Counter(c["category"] for c in CASES)
    assert len(per_category) >= 20 and min(per_category.values()) >= 5, per_category
    labels = Counter(c["label"] for c in CASES)
    assert labels[0] >= 150 and labels[1] >= 150, labels  # enough negatives to count false positives


@pytest.fixture(scope="module")
def scored():
    out = math_accuracy_reward([None] * len(CASES), [c["completion"] for c in CASES], [c["gold"] for c in CASES])
    return [int(s) for s in out]


def _report(cases, scores):
    lines = []
    for c, s in zip(cases, scores):
        if s != c["label"]:
            lines.append(f"id {c['id']} [{c['category']}] label {c['label']} got {s}: {c['completion'][-70:]!r} "
                         f"vs {str(c['gold'])[-40:]!r}")
    return "\n".join(lines)


@pytest.mark.parametrize("style", ["gsm8k", "math"])
def test_agreement_with_labels(scored, style):
    pairs = [(c, s) for c, s in zip(CASES, scored) if c["style"] == style]
    agree = sum(s == c["label"] for c, s in pairs) / len(pairs)
    assert agree >= 0.93, f"{style}: {agree:.3f}\n" + _report(*zip(*pairs))


def test_false_positives_at_most_one_per_500(scored):
    false_pos = [c for c, s in zip(CASES, scored) if s == 1 and c["label"] == 0]
    assert len(false_pos) <= len(CASES) // 500, _report(false_pos, [1] * len(false_pos))


def test_overall_agreement_and_every_category(scored):
    agree = sum(s == c["label"] for c, s in zip(CASES, scored)) / len(CASES)
    assert agree >= 0.93, _report(CASES, scored)
    for category in {c["category"] for c in CASES}:
        pairs = [(c, s) for c, s in zip(CASES, scored) if c["category"] == category]
        assert sum(s == c["label"] for c, s in pairs) / len(pairs) >= 0.75, category


def test_batch_and_single_calls_agree(scored):
    """Scoring one completion at a time gives the batch's scores (no state leaks between samples)."""
    for c, s in list(zip(CASES, scored))[::7]:
        assert math_accuracy_reward([None], [c["completion"]], [c["gold"]]) == [float(s)], c["id"]
