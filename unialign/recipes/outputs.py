"""The end of a run, in one place: what every script writes once training is over.

``unialign.trainers.finish_run`` writes ``final/`` (the policy's ``save``) and ``summary.json`` (the script's numbers,
the resolved config and algorithm, the loop's counters), both atomically, and refuses a run that trained nothing;
the image scripts add the before / after comparison picture and the lines that load ``final/``
(``finish_image_run``). What a run writes while it trains -- curves, the completions table, checkpoints -- is the
trainers' (``unialign.trainers.outputs``, ``unialign.trainers.checkpoint``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from unialign.trainers import finish_run

if TYPE_CHECKING:
    from unialign.image.evaluate import HeldOutImages

__all__ = ["finish_image_run", "finish_run"]


def finish_image_run(acc, cfg, summary: dict[str, Any], policy, evaluator: HeldOutImages | None = None,
                     results: tuple[dict[str, Any], ...] = (), headline: list[tuple[str, float, float]] = (),
                     counters: dict[str, int] | None = None) -> dict[str, Any]:
    """The end of an image script: with an ``evaluator`` that has prompts and its two ``results`` (before, after
    training), ``<output_dir>/comparison.png`` (``HeldOutImages.save_comparison``, titled with the run's name and
    each ``headline`` (name, before, after)), its path in ``summary["comparison_image"]``; then
    ``unialign.trainers.finish_run`` (``final/`` by ``policy.save``, ``summary.json``) and the lines that load
    ``final/`` (``print_load_snippet``). Returns the summary."""
    from unialign.image.denoiser import print_load_snippet  # diffusers: only when an image run ends

    out = Path(cfg.output_dir)
    if evaluator is not None and evaluator.prompts and len(results) == 2:
        summary["comparison_image"] = str(out / "comparison.png")
        if acc.is_main_process:
            title = f"{out.name}: " + ", ".join(f"{name} {b:.3f} -> {a:.3f}" for name, b, a in headline)
            evaluator.save_comparison(out / "comparison.png", *results, title=title)
    summary = finish_run(acc, cfg, summary, policy.save, counters)
    print_load_snippet(acc, policy, out / "final")
    return summary
