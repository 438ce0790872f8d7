"""The optimizer, its learning-rate schedule (transformers' schedules, bit for bit) and the data order."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from unialign.config import OPTIMIZERS
from unialign.trainers.train_config import TrainConfig


def make_optimizer(params, cfg: TrainConfig):
    """The optimizer named by ``cfg.optim`` and its learning-rate schedule: a ``LambdaLR`` whose multiplier is
    ``lr_lambda(cfg.lr_scheduler_type, cfg.warmup_steps, cfg.max_steps)`` (transformers' schedules).

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


TRANSFORMERS_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at 0-based step ``s`` (the lr of the ``s + 1``-th optimizer step),
    for ``torch.optim.lr_scheduler.LambdaLR``: transformers' ``get_scheduler`` schedule ``kind`` (constant |
    linear | cosine) with ``w = warmup_steps`` linear warm-up steps over ``T = total_steps``:

    * warm-up, ``s < w``: ``(s + 1) / (w + 1)`` -- rises in equal steps to 1 at ``s = w``, never 0;
    * then constant ``1``; linear ``max(0, (T - s) / max(1, T - w))``; cosine
      ``0.5 * (1 + cos(pi * (s - w) / max(1, T - w)))`` -- both 0 at ``s = T``.

    transformers warms up as ``s / w`` instead (its first step has lr 0 and moves no weight), so this is its
    schedule for ``w + 1`` warm-up steps of ``T + 1``, read from its step 1 on: the same line without the lr-0
    step, and from ``s = w`` on transformers' own values for ``(w, T)``, bit for bit
    (``tests/test_library_parts.py``). The result is a ``functools.partial``, so a LambdaLR checkpoint holds
    its empty ``__dict__``, no code. Raises ValueError for another ``kind``."""
    if kind not in TRANSFORMERS_SCHEDULES:
        raise ValueError(f"lr_scheduler_type must be constant, linear or cosine, got {kind!r}")
    from transformers.optimization import get_scheduler  # modality-free: the schedules alone

    probe = torch.optim.SGD([torch.zeros(1)], lr=1.0)  # get_scheduler wants an optimizer; its lambda is kept
    (multiplier,) = get_scheduler(TRANSFORMERS_SCHEDULES[kind], probe, num_warmup_steps=warmup_steps + 1,
                                  num_training_steps=total_steps + 1).lr_lambdas
    return functools.partial(_one_step_on, multiplier)


def _one_step_on(multiplier: Callable[[int], float], step: int) -> float:
    return multiplier(step + 1)
