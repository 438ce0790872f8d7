"""Text preference data in TRL's formats, validated and turned into ``PreferenceBatch``es.

Accepted rows (``datasets`` or a list of dicts):
  * standard:        ``prompt`` (str), ``chosen`` (str), ``rejected`` (str)
  * conversational:  ``prompt`` (list of messages), ``chosen`` / ``rejected`` (lists of messages)
  * implicit prompt: no ``prompt``; ``chosen`` / ``rejected`` are whole conversations sharing a prefix
An optional numeric ``margin`` column is kept (reward models).
"""

from __future__ import annotations

from typing import Any


def _is_messages(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in x)


def normalize_pairs(rows: list[dict[str, Any]], source: str = "dataset") -> list[dict[str, Any]]:
    """Rows -> ``{"prompt", "chosen", "rejected"[, "margin"]}`` with explicit prompts. Raises ValueError
    naming the row and field of the first malformed row."""
    out = []
    for i, row in enumerate(rows):
        for field in ("chosen", "rejected"):
            if field not in row:
                raise ValueError(f"{source} row {i}: missing field {field!r} (keys: {sorted(row)})")
            v = row[field]
            if not (isinstance(v, str) and v.strip()) and not (_is_messages(v) and v):
                raise ValueError(f"{source} row {i}: field {field!r} must be a non-empty string or a list of "
                                 f"messages, got {type(v).__name__}")
        prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
        if prompt is None:  # implicit prompt: the longest common prefix of the two conversations
            if not (_is_messages(chosen) and _is_messages(rejected)):
                raise ValueError(f"{source} row {i}: without a 'prompt' field, 'chosen' and 'rejected' must be "
                                 "conversations (lists of messages) sharing a prompt prefix")
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            if k == 0:
                raise ValueError(f"{source} row {i}: 'chosen' and 'rejected' share no prompt messages")
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        elif not ((isinstance(prompt, str) and prompt.strip()) or _is_messages(prompt)):
            raise ValueError(f"{source} row {i}: field 'prompt' must be a non-empty string or a list of messages")
        pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        pair.update({k: row[k] for k in ("image", "images", "video", "videos") if row.get(k) is not None})  # a VLM's pairs (RLAIF-V)
        if row.get("margin") is not None:
            try:
                pair["margin"] = float(row["margin"])
            except (TypeError, ValueError):
                raise ValueError(f"{source} row {i}: field 'margin' must be a number, got {row['margin']!r}") from None
        out.append(pair)
    if not out:
        raise ValueError(f"{source}: no preference pairs")
    return out


def completion_text(completion: Any) -> str:
    """The assistant text of a completion given as a string or as a list of messages."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role") == "assistant")
