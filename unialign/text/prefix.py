"""Prompt-prefix sharing: each distinct prompt of a batch run once, its KV cache shared by the samples that
repeat it (a GRPO group), in generation's prefill and in the training forward alike."""

from __future__ import annotations

import functools
import inspect
from typing import Any

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


def reserve_room(cache: Any, tokens: int) -> Any:
    """``cache`` (a transformers ``DynamicCache``, filled) with room for ``tokens`` more positions in every plain
    ``DynamicLayer``: those become ``RoomyLayer`` s, which write new keys / values in place instead of concatenating.
    transformers' dynamic layer copies its whole cache at every decoding step (``torch.cat``: memory traffic that
    grows with the square of the length; about a quarter of the embedded GRPO step's generation on CPU); the
    attention reads a prefix view of the buffer: the same numbers (tested). Other layer kinds (sliding windows,
    quantised) and caches without ``layers`` (older transformers) are left as they are. Not for a forward that
    needs gradients (the writes are in place): generation only."""
    layers = getattr(cache, "layers", None)
    roomy_layer = _roomy_layer_class()
    if layers is None or roomy_layer is None:
        return cache
    for i, layer in enumerate(layers):
        if type(layer) is roomy_layer.__base__ and layer.is_initialized and getattr(layer.keys, "ndim", 0) == 4:
            roomy = roomy_layer.__new__(roomy_layer)
            roomy.__dict__.update(layer.__dict__)
            roomy.room = tokens
            roomy.reserve(0)
            layers[i] = roomy
    return cache


@functools.cache
def _roomy_layer_class() -> type | None:
    """``RoomyLayer`` (built on first use, so that importing this module does not import transformers), or None
    where transformers has no per-layer caches."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - transformers before per-layer caches
        return None

    class RoomyLayer(DynamicLayer):
        """A ``DynamicLayer`` whose ``keys`` / ``values`` [B, H, S, D] are prefix views of buffers holding ``room``
        more positions (``reserve_room``): ``update`` writes the new states after them, in place, and reserves
        again (its length plus ``room``) only when they no longer fit or the views were replaced (``reorder_cache``,
        ``batch_select_indices``: their results are fresh tensors)."""

        room: int = 0

        def reserve(self, extra: int) -> None:
            """Move keys / values into new buffers of their length + ``extra`` + ``room`` positions."""
            for name in ("keys", "values"):
                held = getattr(self, name)
                B, H, S, D = held.shape
                buf = held.new_empty(B, H, S + extra + self.room, D)
                buf[:, :, :S].copy_(held)
                setattr(self, name, buf[:, :, :S])
                setattr(self, f"{name}_buffer", buf)

        def fits(self, new: int) -> bool:
            """Whether ``new`` positions fit after the current views of the buffers."""
            kb, vb = getattr(self, "keys_buffer", None), getattr(self, "values_buffer", None)
            return (kb is not None and vb is not None and self.keys.data_ptr() == kb.data_ptr()
                    and self.values.data_ptr() == vb.data_ptr() and self.keys.stride() == kb.stride()
                    and self.values.stride() == vb.stride() and self.keys.shape[:2] == kb.shape[:2]
                    and self.keys.shape[2] + new <= kb.shape[2])

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized or getattr(self.keys, "ndim", 0) != 4:
                return super().update(key_states, value_states, *args, **kwargs)
            new = key_states.shape[-2]
            if not self.fits(new):
                self.reserve(new)
            S = self.keys.shape[2]
            self.keys_buffer[:, :, S:S + new].copy_(key_states)
            self.values_buffer[:, :, S:S + new].copy_(value_states)
            self.keys, self.values = self.keys_buffer[:, :, :S + new], self.values_buffer[:, :, :S + new]
            return self.keys, self.values

    return RoomyLayer


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
    layers = getattr(cache, "layers", None)
    if layers is None or not all(_plain_layer(la) for la in layers):
        cache.reorder_cache(inverse_B)  # older transformers, or layers holding more than keys and values
        return {key: cache}
    for layer in layers:
        layer.keys, layer.values = gather_rows(layer.keys, inverse_B), gather_rows(layer.values, inverse_B)
    return {key: cache}


def _plain_layer(layer: Any) -> bool:
    """Whether ``layer`` is a cache layer whose rows are its ``keys`` and ``values`` alone (transformers' own
    ``reorder_cache`` gathers nothing else), both filled."""
    try:
        from transformers.cache_utils import CacheLayerMixin
    except ImportError:  # pragma: no cover - transformers before per-layer caches
        return False
    return (isinstance(layer, CacheLayerMixin) and type(layer).reorder_cache is CacheLayerMixin.reorder_cache
            and isinstance(layer.keys, torch.Tensor) and isinstance(layer.values, torch.Tensor)
            and layer.keys.dim() == 4)


def gather_rows(src_U: torch.Tensor, index_B: torch.Tensor) -> torch.Tensor:
    """``src_U.index_select(0, index_B)`` [B, ...] whose backward makes the incoming gradient contiguous before
    summing it back to the U rows: the same sum in the same order as autograd's own (bit for bit, tested), at a
    fraction of its cost. A prefix's cache is read through a ``torch.cat`` with the completion's keys / values, so
    its gradient arrives as a strided slice, and ``index_add_`` over a strided source is several times slower (the
    gather's backward was 5 % of the embedded GRPO step on CPU)."""
    if not src_U.requires_grad:
        return src_U.index_select(0, index_B)
    return _GatherRows.apply(src_U, index_B)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src_U: torch.Tensor, index_B: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index_B)
        ctx.rows = src_U.shape[0]
        return src_U.index_select(0, index_B)

    @staticmethod
    def backward(ctx, grad_B: torch.Tensor):
        (index_B,) = ctx.saved_tensors
        grad_U = grad_B.new_zeros((ctx.rows, *grad_B.shape[1:]))
        return grad_U.index_add_(0, index_B, grad_B.contiguous()), None
