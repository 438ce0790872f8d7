"""Pieces every trainer loop shares: atomic checkpoints, run summaries and curves, schedules."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CHECKPOINT_PREFIX = "checkpoint-"


@dataclass
class TrainConfig:
    """Fields every loop shares: optimisation, schedule, seeding, logging and checkpoints."""

    max_steps: int = 100
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim: str = "adamw_torch"  # adamw_torch | adafactor | adamw_8bit (TRL / transformers names)
    lr_scheduler_type: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; tiny models run fastest on 1
    output_dir: str = "outputs/run"
    logging_steps: int = 1
    save_steps: int = 0
    save_total_limit: int = 2
    report_to: str = "tensorboard"
    resume_from_checkpoint: str | None = None


OPTIMIZERS = ("adamw_torch", "adafactor", "adamw_8bit")


def make_optimizer(params, cfg: TrainConfig):
    """The optimizer named by ``cfg.optim`` and its LambdaLR schedule.

    adamw_torch: ``torch.optim.AdamW``. adafactor: ``torch.optim.Adafactor`` with the given learning rate
    (factored second moments, no first moment: optimizer state ~O(rows + cols) per matrix).
    adamw_8bit: bitsandbytes' ``AdamW8bit`` (8-bit moments; needs ``pip install bitsandbytes`` and,
    in practice, a GPU)."""
    if cfg.optim == "adamw_torch":
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                      betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    elif cfg.optim == "adafactor":  # clip threshold d = 1, a fixed lr: DiffusionDPO's SDXL settings
        optimizer = torch.optim.Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    elif cfg.optim == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("optim='adamw_8bit' needs bitsandbytes: pip install bitsandbytes "
                             "(or use optim='adafactor')") from None
        optimizer = bnb.optim.AdamW8bit(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                        betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    else:
        raise ValueError(f"optim: unknown optimizer {cfg.optim!r}; choose one of {', '.join(OPTIMIZERS)}")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.lr_scheduler_type, cfg.warmup_steps, cfg.max_steps))
    return optimizer, scheduler


def epoch_order(cursor: int, n: int, count: int, seed: int) -> list[int]:
    """Row indices ``cursor .. cursor + count`` of an endless stream of epochs, each a permutation of
    ``range(n)`` seeded by (seed, epoch): the same on every process and after a resume."""
    out = []
    for c in range(cursor, cursor + count):
        epoch, pos = divmod(c, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch))
        out.append(int(perm[pos]))
    return out


def atomic_replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a fully written ``tmp_dir`` to ``final_dir`` so that a crash never leaves a half checkpoint:
    the old directory (if any) is moved aside first and deleted only after the rename."""
    old = final_dir.with_name(final_dir.name + ".old")
    if final_dir.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old.exists():
        shutil.rmtree(old)


def write_json_atomic(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=float))
    os.replace(tmp, path)


def finish_run(acc, cfg, summary: dict, save) -> dict:
    """End of a script: on the main process, ``save(<output_dir>/final)`` (stock-loadable weights), write
    ``summary.json`` with the run's config added, and print the summary. Returns the summary."""
    summary["config"] = {k: v for k, v in asdict(cfg).items() if v is not None}
    if acc.is_main_process:
        out = Path(cfg.output_dir)
        save(str(out / "final"))
        write_json_atomic(out / "summary.json", summary)
        acc.print({k: v for k, v in summary.items() if k != "config"})
    return summary


def find_checkpoint(output_dir: str | Path, which: str) -> Path | None:
    """``which`` is a checkpoint path or ``"latest"`` (the highest step under ``output_dir``)."""
    if which != "latest":
        path = Path(which)
        if not (path / "trainer_state.pt").exists():
            raise FileNotFoundError(f"resume_from_checkpoint={which!r}: no trainer_state.pt in that directory")
        return path
    ckpts = sorted(Path(output_dir).glob(CHECKPOINT_PREFIX + "*[0-9]"), key=lambda p: int(p.name.split("-")[-1]))
    ckpts = [c for c in ckpts if (c / "trainer_state.pt").exists()]
    return ckpts[-1] if ckpts else None


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    ckpts = sorted(Path(output_dir).glob(CHECKPOINT_PREFIX + "*[0-9]"), key=lambda p: int(p.name.split("-")[-1]))
    for path in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def lr_lambda(kind: str, warmup_steps: int, total_steps: int):
    """Multiplier schedule for ``torch.optim.lr_scheduler.LambdaLR``: constant | linear | cosine, with warmup."""
    if kind not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_scheduler_type must be constant, linear or cosine, got {kind!r}")

    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if kind == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return max(0.0, 1 - progress) if kind == "linear" else 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


def save_curves(history: list[dict], path: str | Path, keys: tuple[str, ...] = ("reward/mean",)) -> None:
    """Plot metrics over steps to a PNG (one panel per key present in the history, four to a row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(k in h for h in history)]
    if not keys:
        return
    cols = min(len(keys), 4)
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, key in zip(axes.flat, keys):
        pts = [(h["step"], h[key]) for h in history if key in h and math.isfinite(h[key])]
        if pts:
            ax.plot(*zip(*pts), marker=".")
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
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


def save_checkpoint(acc, output_dir: str | Path, step: int, state: dict, keep: int) -> Path:
    """accelerate state (model, optimizer, scheduler, RNGs) + the loop's own ``state`` dict, written to a
    temporary directory and renamed into ``checkpoint-<step>`` only once complete; older ones pruned."""
    out = Path(output_dir)
    final, tmp = out / f"{CHECKPOINT_PREFIX}{step}", out / f".tmp-{CHECKPOINT_PREFIX}{step}"
    acc.save_state(str(tmp))
    if acc.is_main_process:
        torch.save(state, tmp / "trainer_state.pt")
        atomic_replace_dir(tmp, final)
        prune_checkpoints(out, keep)
    acc.wait_for_everyone()
    return final


def load_checkpoint(acc, path: str | Path) -> dict:
    """Restore accelerate state from ``path`` and return the loop's own state dict."""
    acc.load_state(str(path))
    return torch.load(Path(path) / "trainer_state.pt", weights_only=False)
