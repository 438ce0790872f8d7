"""Benchmark P11's reading of finished runs: the seconds to the threshold, the docs' table and the curves figure, on
runs written by hand (the numbers below are worked out from them, not read back from the code)."""

from __future__ import annotations

from PIL import Image

from benchmarks.p11_forward import curves_figure, markdown_table, seconds_to


def fake_run(curve, after=0.9):
    """A ``read_run`` result: ``curve`` of (step, training seconds, verifier fidelity, reader fidelity)."""
    return {"curve": curve, "fidelity_before": curve[0][2], "fidelity_after": after,
            "fidelity_reader_before": curve[0][3], "fidelity_reader_after": after - 0.1, "gold_before": 0.67,
            "gold_after": 0.76, "train_seconds": curve[-1][1], "step_ratios": None}


SLOW = [(0, 0.0, 0.5, 0.4), (5, 30.0, 0.9, 0.6), (10, 60.0, 0.8, 0.7), (15, 90.0, 0.86, 0.8)]
FAST = [(0, 0.0, 0.5, 0.4), (5, 10.0, 0.84, 0.6), (10, 20.0, 0.85, 0.7), (15, 30.0, 0.9, 0.8)]


def test_seconds_to_the_first_evaluation_after_step_0_at_or_above_the_threshold():
    assert seconds_to(SLOW, 0.85) == 30.0  # the first crossing counts, a later dip does not undo it
    assert seconds_to(FAST, 0.85) == 20.0  # "at or above": 0.85 itself reaches it
    assert seconds_to(FAST, 0.95) is None
    assert seconds_to([(0, 0.0, 0.9, 0.9), (5, 10.0, 0.7, 0.7)], 0.85) is None  # step 0 never counts


def test_the_table_gives_each_seed_and_the_ratio_of_medians_to_flow_grpo():
    res = {"flow_grpo": [fake_run(SLOW), fake_run(SLOW), fake_run(FAST)],  # 30, 30, 20 s: median 30
           "dgpo": [fake_run(FAST), fake_run(FAST), fake_run(SLOW)]}       # 20, 20, 30 s: median 20
    lines = markdown_table(res).splitlines()
    flow, dgpo = (next(line for line in lines if line.startswith(f"| {label}")) for label in ("Flow-GRPO", "DGPO"))
    assert "| 30 / 30 / 20 |" in flow and "×" not in flow.split("|")[2]
    assert "| 20 / 20 / 30 (0.67×) |" in dgpo  # 20 / 30
    assert "0.500 → 0.900 / 0.900 / 0.900" in dgpo and "0.400 → 0.800 / 0.800 / 0.800" in dgpo


def test_the_curves_figure_has_a_row_for_one_epoch_and_one_for_four(tmp_path):
    res = {"flow_grpo": [fake_run(SLOW)], "dgpo": [fake_run(FAST)], "flow_grpo-4ep": [fake_run(SLOW)]}
    both = Image.open(curves_figure(res, tmp_path / "both.png"))
    one = Image.open(curves_figure({"dgpo": [fake_run(FAST)]}, tmp_path / "one.png"))
    assert both.width == one.width and both.height == 2 * one.height
