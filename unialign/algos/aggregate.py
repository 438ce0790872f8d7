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

import torch

Tensor = torch.Tensor

AGGREGATION_ALIASES = {
    "token_mean": "token_mean", "token-mean": "token_mean", "dapo": "token_mean", "bnpo": "token_mean",
    "seq_mean_token_mean": "seq_mean_token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
    "grpo": "seq_mean_token_mean",
    "seq_mean_token_sum": "seq_mean_token_sum", "seq-mean-token-sum": "seq_mean_token_sum",
    "seq_mean_token_sum_norm": "seq_mean_token_sum_norm", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
    "dr_grpo": "seq_mean_token_sum_norm",
}


def _mode(mode: str) -> str:
    try:
        return AGGREGATION_ALIASES[mode]
    except KeyError:
        raise ValueError(f"unknown aggregation mode {mode!r}; use one of {sorted(AGGREGATION_ALIASES)}") from None


def local_normalizer(mask_B_T: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """This (micro-)batch's contribution to the normaliser of ``mode`` (a float scalar tensor):
    unmasked steps (token_mean), non-empty samples (seq_mean_*), or B * T_max
    (seq_mean_token_sum_norm, T_max = ``max_len`` or the mask's width)."""
    mode = _mode(mode)
    mask = mask_B_T.to(torch.float32)
    if mode == "token_mean":
        return mask.sum()
    if mode == "seq_mean_token_sum_norm":
        return torch.tensor(float(mask.shape[0] * (max_len or mask.shape[1])), device=mask.device)
    return (mask.sum(-1) > 0).to(torch.float32).sum()


def aggregate(loss_B_T: Tensor, mask_B_T: Tensor, mode: str, normalizer: float | Tensor | None = None) -> Tensor:
    """Scalar loss from a per-step loss (see the module docstring for the modes).

    ``loss_B_T``, ``mask_B_T``: [B, T]. ``normalizer``: the denominator to use; ``None`` means this
    batch's own (``local_normalizer``), i.e. a plain mean over this batch. An empty batch gives 0.
    """
    mode = _mode(mode)
    mask = mask_B_T.to(loss_B_T.dtype)
    if normalizer is None:
        normalizer = local_normalizer(mask_B_T, mode)
    normalizer = torch.as_tensor(normalizer, dtype=loss_B_T.dtype, device=loss_B_T.device).clamp(min=1e-8)
    masked = loss_B_T * mask
    if mode in ("token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum"):
        return masked.sum() / normalizer
    per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)  # all-masked rows give 0
    return per_seq.sum() / normalizer
