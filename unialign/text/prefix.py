"""Prompt-prefix sharing: each distinct prompt of a batch run once, its KV cache shared by the samples that
repeat it (a GRPO group), in generation's prefill and in the training forward alike."""

from __future__ import annotations

import inspect

import torch

from unialign.dist import fsdp2_root, unwrap


def right_align(ids_B_W: torch.Tensor, mask_B_W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Roll each row right so that its last attended token sits in the last column."""
    W = mask_B_W.shape[1]
    last = (mask_B_W * torch.arange(1, W + 1, device=mask_B_W.device)).argmax(-1)  # index of last attended
    shift = (W - 1 - last).unsqueeze(-1)
    if not bool(shift.any()):
        return ids_B_W, mask_B_W
    idx = (torch.arange(W, device=ids_B_W.device) - shift) % W
    return ids_B_W.gather(1, idx), mask_B_W.gather(1, idx)


def cache_kwarg(lm: torch.nn.Module) -> str:
    """The KV-cache argument / output name: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(type(lm).forward).parameters else "past_key_values"


def shared_prompt_cache(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """Shared-prefix pass: run each *distinct* prompt (all but its last token) once and return its KV
    cache gathered back to one row per sample, or None when that cannot help or is not safe.

    A GRPO batch holds each prompt G times; the standard pass recomputes the prompt for every
    sample in the forward and the backward. Here the prompt's keys / values are computed for the U
    distinct prompts and indexed out to the B samples (``index_select``, differentiable: gradients
    of all G samples flow back into one prompt pass), so the per-sample pass costs T + 1 tokens
    instead of W + T. Same numbers as the standard pass up to float rounding (tested). Not used
    under a distributed wrapper (two forwards per backward), with gradient checkpointing (no
    cache in training), when no prompt repeats, or when a prompt has fewer than two tokens.
    """
    if prompt_ids.shape[1] < 2 or not prefix_sharing_safe(model):
        return None
    rows = torch.cat([prompt_ids, prompt_mask], dim=1)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if distinct.shape[0] == rows.shape[0]:
        return None
    W = prompt_ids.shape[1]
    ids, mask = distinct[:, :W - 1], distinct[:, W:2 * W - 1]
    if bool((mask.sum(-1) < 1).any()):  # an empty prefix would be a fully masked attention row
        return None
    return cached_prefix(model, inverse, input_ids=ids, attention_mask=mask,
                         position_ids=(mask.cumsum(-1) - 1).clamp(min=0))


def prefix_sharing_safe(model: torch.nn.Module) -> bool:
    """Whether a prefix pass may run on ``model``: not under a distributed wrapper (two forwards per backward),
    not under FSDP2 (the gathered cache's storage is freed on reshard before the backward needs it), not with
    gradient checkpointing (no cache in training)."""
    if model is not unwrap(model) or fsdp2_root(model) is not None:
        return False
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    checkpointing = "is_activation_checkpointing" if hasattr(type(lm), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"  # transformers < 5 name
    return not getattr(lm, checkpointing, False)


def cached_prefix(model: torch.nn.Module, inverse_B: torch.Tensor, **inputs) -> dict | None:
    """Run the U distinct prefixes (``inputs``: ``input_ids`` [U, W'] and the rest of the model's inputs) once and
    return ``{cache kwarg: cache}`` gathered back to one row per sample (``inverse_B`` [B]: each sample's prefix),
    or None when the model returns no cache."""
    out = model(logits_to_keep=1, use_cache=True, **inputs)
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    key = cache_kwarg(lm)
    cache = out.get(key)
    if cache is None:
        return None
    cache.reorder_cache(inverse_B)
    return {key: cache}
