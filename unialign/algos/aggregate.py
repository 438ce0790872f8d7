"""Reduce a per-step loss [B, T] to a scalar: the one place GRPO, DAPO and Dr.GRPO differ.

Modes (verl's names with underscores; TRL / verl aliases accepted):

    token_mean              sum(L * m) / N_tokens                    DAPO (Yu et al. 2025, eq. 12); TRL "dapo", "bnpo"
    seq_mean_token_mean     1/N_seq * sum_i [sum_t L*m / |y_i|]      GRPO (Shao et al. 2024, eq. 3); TRL "grpo"
    seq_mean_token_sum      1/N_seq * sum_i sum_t L*m                sequence-level REINFORCE / RLOO
    seq_mean_token_sum_norm sum(L * m) / (B * T_max)                 Dr.GRPO (Liu et al. 2025, eq. 2); TRL "dr_grpo"

N_tokens counts unmasked steps and N_seq counts samples with at least one unmasked step.

Split invariance: to make loss and gradient independent of how an optimizer step's batch is cut
into micro-batches and processes, compute ``normalizer`` ONCE per optimizer step: the sum of
``local_normalizer`` over every micro-batch of every process, divided by the number of processes
when gradients are averaged across processes (DDP). Then the sum over micro-batches of
``aggregate(..., normalizer=that)`` is the full-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Aggregation:
    """A registered mode: ``normalizer(mask_B_T, max_len) -> scalar`` (one micro-batch's share of the
    denominator) and ``reduce(masked_loss_B_T, mask_B_T, normalizer) -> scalar``."""

    normalizer: Callable[[Tensor, int | None], Tensor]
    reduce: Callable[[Tensor, Tensor, Tensor], Tensor]


AGGREGATIONS: dict[str, Aggregation] = {}
AGGREGATION_ALIASES: dict[str, str] = {}


def register_aggregation(name: str, normalizer: Callable[[Tensor, int | None], Tensor], aliases: tuple[str, ...] = ()):
    """Decorator over ``reduce``: registers the mode ``name`` (and its TRL / verl ``aliases``)."""
    def add(reduce: Callable[[Tensor, Tensor, Tensor], Tensor]):
        if name in AGGREGATIONS:
            raise ValueError(f"aggregation mode {name!r} is already registered")
        AGGREGATIONS[name] = Aggregation(normalizer, reduce)
        for alias in (name, name.replace("_", "-"), *aliases):
            AGGREGATION_ALIASES[alias] = name
        return reduce
    return add


def _count_tokens(mask: Tensor, max_len: int | None) -> Tensor:
    return mask.sum()


def _count_sequences(mask: Tensor, max_len: int | None) -> Tensor:
    return (mask.sum(-1) > 0).to(torch.float32).sum()


def _batch_times_max_len(mask: Tensor, max_len: int | None) -> Tensor:
    return torch.tensor(float(mask.shape[0] * (max_len or mask.shape[1])), device=mask.device)


def _sum_over(masked: Tensor, mask: Tensor, normalizer: Tensor) -> Tensor:
    return masked.sum() / normalizer


register_aggregation("token_mean", _count_tokens, aliases=("dapo", "bnpo"))(_sum_over)
register_aggregation("seq_mean_token_sum", _count_sequences)(_sum_over)
register_aggregation("seq_mean_token_sum_norm", _batch_times_max_len, aliases=("dr_grpo",))(_sum_over)


@register_aggregation("seq_mean_token_mean", _count_sequences, aliases=("grpo",))
def _mean_of_sequence_means(masked: Tensor, mask: Tensor, normalizer: Tensor) -> Tensor:
    per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)  # all-masked rows give 0
    return per_seq.sum() / normalizer


def _mode(mode: str) -> str:
    try:
        return AGGREGATION_ALIASES[mode]
    except KeyError:
        raise ValueError(f"unknown aggregation mode {mode!r}; use one of {sorted(AGGREGATION_ALIASES)}") from None


def local_normalizer(mask_B_T: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """This (micro-)batch's contribution to the normaliser of ``mode`` (a float scalar tensor):
    unmasked steps (token_mean), non-empty samples (seq_mean_*), or B * T_max
    (seq_mean_token_sum_norm, T_max = ``max_len`` or the mask's width)."""
    return AGGREGATIONS[_mode(mode)].normalizer(mask_B_T.to(torch.float32), max_len)


def aggregate(loss_B_T: Tensor, mask_B_T: Tensor, mode: str, normalizer: float | Tensor | None = None) -> Tensor:
    """Scalar loss from a per-step loss (see the module docstring for the modes).

    ``loss_B_T``, ``mask_B_T``: [B, T]. ``normalizer``: the denominator to use; ``None`` means this
    batch's own (``local_normalizer``), i.e. a plain mean over this batch. An empty batch gives 0.
    """
    entry = AGGREGATIONS[_mode(mode)]
    mask = mask_B_T.to(loss_B_T.dtype)
    if normalizer is None:
        normalizer = local_normalizer(mask_B_T, mode)
    normalizer = torch.as_tensor(normalizer, dtype=loss_B_T.dtype, device=loss_B_T.device).clamp(min=1e-8)
    return entry.reduce(loss_B_T * mask, mask, normalizer)
