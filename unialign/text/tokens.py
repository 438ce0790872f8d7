"""Prompt tokenization with the special tokens the model was trained with: one rule, used everywhere.

A tokenizer that adds BOS (Llama, Mistral, Gemma base models) puts it before every text encoded
with its defaults, and its model was trained on such sequences; a chat template written for such a
model already starts with the BOS *text*. So:

  * a raw-text prompt gets the special tokens the tokenizer puts **before** a text (``[BOS]``, or
    nothing for GPT-2 / Qwen / the demo arithmetic model) — never those it would put after it
    (an EOS some tokenizers append would end the prompt before the completion starts). A raw text
    that already starts with those tokens (e.g. a literal ``"<s>"``) does not get them twice;
  * a chat-templated prompt is the template's tokens exactly, as ``apply_chat_template(...,
    tokenize=True)`` gives them: the template carries the BOS when the model wants one, and adding
    the tokenizer's would double it.

``model.generate(**tokenizer(raw_text, return_tensors="pt"))`` therefore sees the same prompt ids as
``CausalLMPolicy.sample`` (when the tokenizer adds nothing after the text). The policy's sampling,
training forward, evaluation and pair losses, and the reward model, all encode prompts here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_PROBES = ("a", "0", "Hello", "x y")


def special_prefix_ids(tokenizer: Any) -> list[int]:
    """The ids ``tokenizer`` puts before a text with ``add_special_tokens=True`` (e.g. ``[bos_id]``).

    Found by encoding a probe text with and without special tokens and locating the plain encoding
    inside the full one (whatever follows it, e.g. an appended EOS, is not part of the prefix).
    Computed per call (two tiny encodings), so a tokenizer changed in place (``add_bos_token``) is
    followed.
    """
    for probe in _PROBES:
        plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        if not plain:
            continue
        full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
        for k in range(len(full) - len(plain) + 1):
            if full[k:k + len(plain)] == plain:
                return full[:k]
    return []


def encode_prompt(tokenizer: Any, text: str, templated: bool, prefix: Sequence[int] | None = None) -> list[int]:
    """Token ids of one prompt: ``text`` as is when ``templated`` (a chat template's output), else the
    tokenizer's special prefix (``special_prefix_ids``; pass ``prefix`` to reuse it across a batch)
    followed by ``text``'s tokens, unless they already start with it."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return _with_prefix(ids, templated, special_prefix_ids(tokenizer) if prefix is None and not templated else prefix)


def _with_prefix(ids: list[int], templated: bool, prefix: Sequence[int] | None) -> list[int]:
    if templated or not prefix:
        return ids
    prefix = list(prefix)
    return ids if ids[:len(prefix)] == prefix else prefix + ids


def _truncate(ids: list[int], keep_head: int, max_length: int, side: str) -> list[int]:
    """At most ``max_length`` ids: the first ``keep_head`` (special prefix) kept, the rest cut on ``side``."""
    if len(ids) <= max_length:
        return ids
    head, body = ids[:keep_head], ids[keep_head:]
    room = max(0, max_length - len(head))
    return head + (body[len(body) - room:] if side == "left" else body[:room])


def encode_prompts(tokenizer: Any, texts: Sequence[str], templated: bool | Sequence[bool],
                   max_length: int | None = None, padding_side: str | None = None) -> dict[str, torch.Tensor]:
    """A padded batch of prompts (``encode_prompt`` per text): ``input_ids`` and ``attention_mask`` [B, W].

    ``templated``: one flag for all texts or one per text. ``max_length``: texts longer than that are
    cut on the tokenizer's ``truncation_side`` (as ``tokenizer(..., truncation=True)`` does), the special
    prefix of a raw prompt always kept. ``padding_side``: default the tokenizer's (left for generation).
    """
    flags = [templated] * len(texts) if isinstance(templated, bool) else list(templated)
    if len(flags) != len(texts):
        raise ValueError(f"templated: {len(flags)} flags for {len(texts)} texts")
    prefix = special_prefix_ids(tokenizer) if not all(flags) else []
    plain = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if len(texts) else []
    rows = []
    for ids, flag in zip(plain, flags):
        ids = _with_prefix(list(ids), flag, prefix)
        if max_length is not None:
            head = len(prefix) if not flag and ids[:len(prefix)] == prefix else 0
            ids = _truncate(ids, head, max_length, getattr(tokenizer, "truncation_side", "right"))
        rows.append(ids)
    side = padding_side or getattr(tokenizer, "padding_side", "left")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    W = max((len(r) for r in rows), default=0)
    input_ids = torch.full((len(rows), W), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), W), dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(W - len(r), W) if side == "left" else slice(0, len(r))
        input_ids[i, span] = torch.tensor(r, dtype=torch.long)
        mask[i, span] = 1
    return {"input_ids": input_ids, "attention_mask": mask}
