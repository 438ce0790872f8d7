"""Prompt datasets for text RL, validated: TRL's prompt formats, GSM8K's schema, token limits.

Accepted rows (any source of ``unialign.data``, or a data set registered by name in ``NAMED_DATASETS``):

* standard (TRL):        ``{"prompt": "What is 2+2?", "solution": "4", ...}``
* conversational (TRL):  ``{"prompt": [{"role": "user", "content": "What is 2+2?"}], ...}``
* GSM8K:                 ``{"question": "...", "answer": "... #### 4"}`` (``question`` becomes ``prompt``, a string:
  used raw unless ``--chat_template always``; ``{"question", "solution"}`` rows alike, ``solution`` a column)

Every column other than ``prompt`` reaches the reward functions as a keyword argument (TRL's
``reward(prompts, completions, **columns)``): ``answer`` for ``math_accuracy``, ``solution`` or anything
else for your own reward. ``limit_rows`` refuses (or drops, counted) rows whose prompt or completion is
longer than a token limit, naming them, before any model forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unialign.config import UserError
from unialign.data import load_dataset_rows

ROLES = ("system", "user", "assistant", "tool", "developer")

# in-memory data sets by name: name -> rows(split, n) (prompt rows) / pairs(split, n, seed) (preference
# pairs); a package registers its own (the demo worlds do, on import) and every loader here accepts the name
NAMED_DATASETS: dict[str, Callable[[str, int | None], list[dict[str, Any]]]] = {}
NAMED_PAIR_DATASETS: dict[str, Callable[[str, int | None, int], list[dict[str, Any]]]] = {}


def load_rows(name: str, split: str, config_name: str | None = None, n: int | None = None,
              encoding_errors: str = "strict") -> list[dict[str, Any]]:
    """Rows of a dataset: a name in ``NAMED_DATASETS``, a local .jsonl/.json/.parquet file (all of it) or
    folder (the split's files), or a Hugging Face Hub id (fails at once offline); the first ``n`` when given
    (a local file is read no further)."""
    if name in NAMED_DATASETS:
        return NAMED_DATASETS[name](split, n)
    return load_dataset_rows(name, split, config_name, encoding_errors=encoding_errors, limit=n or None)


def is_messages(value: Any) -> bool:
    """A non-empty conversation: a list of ``{"role", "content"}`` dicts (content a string or a list of parts)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
        for m in value)


def prompt_rows(rows: list[dict[str, Any]], source: str = "dataset", prompt_column: str = "prompt"
                ) -> list[dict[str, Any]]:
    """Rows in TRL's standard / conversational prompt format or GSM8K's schema -> ``{"prompt", <columns>}``;
    ``prompt_column`` (``--prompt_column``, e.g. geometry3k's ``problem``) is read as ``prompt`` first. Raises
    ``UserError`` naming the first bad row and field."""
    if not rows:
        raise UserError(f"{source}: no rows")
    if prompt_column != "prompt":
        for i, row in enumerate(rows):
            if prompt_column not in row:
                raise UserError(f"--prompt_column {prompt_column!r}: {source} row {i} has no such column; columns: "
                                f"{sorted(row)}")
        rows = [{**{k: v for k, v in r.items() if k not in (prompt_column, "prompt")}, "prompt": r[prompt_column]}
                for r in rows]
    out = []
    for i, row in enumerate(rows):
        if "prompt" in row:
            prompt = row["prompt"]
            if isinstance(prompt, list):
                if not is_messages(prompt):
                    raise UserError(f"{source} row {i}: field 'prompt' is a list but not a conversation "
                                    "(non-empty list of {'role': str, 'content': str} messages)")
                bad = next((m["role"] for m in prompt if m["role"] not in ROLES), None)
                if bad is not None:
                    raise UserError(f"{source} row {i}: field 'prompt': unknown role {bad!r}; use {', '.join(ROLES)}")
            elif not isinstance(prompt, str) or not prompt.strip():
                raise UserError(f"{source} row {i}: field 'prompt' must be a non-empty string or a list of "
                                f"messages, got {_short(prompt)}")
            out.append(dict(row))
        elif "question" in row:
            out.append(_gsm8k_row(row, i, source))
        else:
            raise UserError(f"{source} row {i}: no 'prompt' column (TRL format) and no 'question' / 'answer' "
                            f"(GSM8K format); columns: {sorted(row)}")
    return out


def _gsm8k_row(row: dict[str, Any], i: int, source: str) -> dict[str, Any]:
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise UserError(f"{source} row {i}: field 'question' must be a non-empty string, got {_short(question)}")
    if "answer" not in row:  # {"question", "solution", ...}: the question is the prompt, the rest reward columns
        return {"prompt": question, **{k: v for k, v in row.items() if k != "question"}}
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise UserError(f"{source} row {i}: field 'answer' must be a non-empty string (GSM8K: ending "
                        f"'#### <number>'), got {_short(answer)}")
    rest = {k: v for k, v in row.items() if k not in ("question", "answer")}
    return {"prompt": question, "answer": answer, **rest}


def gsm8k_prompts(rows: list[dict[str, Any]], source: str = "dataset") -> list[dict[str, Any]]:
    """GSM8K-schema rows (``question``, ``answer``) -> ``{"prompt", "answer"}`` rows (``UserError`` naming
    the first bad row)."""
    if not rows:
        raise UserError(f"{source}: no rows")
    return [_gsm8k_row(r, i, source) for i, r in enumerate(rows)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------ token limits
Counter = Callable[[list[Any], int], list[int]]
# a token covers at least one UTF-8 byte of its text, except the few a tokenizer adds (BOS / EOS, a
# SentencePiece dummy prefix): a text of b bytes has at most b + SPECIAL_SLACK tokens
SPECIAL_SLACK = 4
# a text up to this many UTF-8 bytes is tokenized for its exact count whenever it could be over a limit (well
# under a second); only a longer one that cannot fit even at the longest token is given a lower bound instead
EXACT_COUNT_BYTES = 1 << 18


class AtLeast(int):
    """A token count known only from below: the text is longer than a limit without being tokenized."""


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes of text one token of ``tokenizer`` stands for: the longest vocabulary entry in
    UTF-8 bytes, times 4 (a normalizer may map up to 4 bytes of text to one byte of a token, e.g. NFKC). Computed
    once per tokenizer."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_BYTES:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        _MAX_TOKEN_BYTES[key] = 4 * max((len(str(t).encode("utf-8")) for t in vocab), default=64)
    return _MAX_TOKEN_BYTES[key]


_MAX_TOKEN_BYTES: dict[int, int] = {}


def bounded_counts(texts: list[str], limit: int, tokenize: Callable[[list[str]], list[int]],
                   bytes_per_token: int | None = None) -> list[int]:
    """Token counts of ``texts``: exact for any text whose UTF-8 length could exceed ``limit`` tokens, else
    that (never exceeded) bound, so that the short texts of a large dataset are not tokenized at all. With
    ``bytes_per_token`` (``max_token_bytes``), a text too long to fit in ``limit`` tokens even at that many bytes
    a token and longer than ``EXACT_COUNT_BYTES`` is not tokenized either: its count is
    ``AtLeast(bytes // bytes_per_token)`` (a 40 M-character prompt is refused at once, not after minutes of
    tokenizing and gigabytes of ids)."""
    sizes = [len(t.encode("utf-8")) for t in texts]
    bounds: list[int] = [b + SPECIAL_SLACK for b in sizes]
    if bytes_per_token:
        for i, b in enumerate(sizes):
            if b > max((limit + SPECIAL_SLACK) * bytes_per_token, EXACT_COUNT_BYTES):
                bounds[i] = AtLeast(b // bytes_per_token)
    idx = [i for i, b in enumerate(bounds) if b > limit and not isinstance(b, AtLeast)]
    for i, n in zip(idx, tokenize([texts[i] for i in idx]) if idx else []):
        bounds[i] = n
    return bounds


def prompt_token_counter(policy) -> Counter:
    """``count(prompts, limit)``: token counts of prompts in ``policy`` (a ``CausalLMPolicy``) -- chat template
    and system prompt applied, with the special tokens the policy adds (BOS on raw text where the tokenizer
    adds one) -- exact wherever a prompt could be longer than ``limit`` (``bounded_counts``)."""
    if hasattr(policy, "count_prompt_tokens"):  # a policy whose prompts hold more than text (image tokens)
        return policy.count_prompt_tokens
    tokenizer = policy.tokenizer

    def count(prompts: list[Any], limit: int) -> list[int]:
        flags = [_templated(policy, p) for p in prompts]
        texts = [policy.format_prompt(p) for p in prompts]
        out = [0] * len(prompts)
        for templated in (True, False):
            idx = [i for i, f in enumerate(flags) if f == templated]
            if not idx:
                continue
            counts = bounded_counts([texts[i] for i in idx], limit, lambda batch, t=templated: [
                len(x) for x in tokenizer(batch, add_special_tokens=not t)["input_ids"]], max_token_bytes(tokenizer))
            for i, n in zip(idx, counts):
                out[i] = n
        return out

    return count


def _templated(policy, prompt: Any) -> bool:
    if hasattr(policy, "is_templated"):
        return policy.is_templated(prompt)
    from unialign.text.prompts import templated

    return templated(getattr(policy, "chat_template", "auto"), prompt)


def completion_token_counter(tokenizer) -> Counter:
    """``count(completions, limit)``: tokens of completions (strings or assistant messages) as the pair
    losses take them, text + EOS (exact wherever they could exceed ``limit``)."""
    from unialign.text.preference import completion_text

    def count(completions: list[Any], limit: int) -> list[int]:
        counts = bounded_counts([completion_text(c) for c in completions], limit - 1, lambda batch: [
            len(x) for x in tokenizer(batch, add_special_tokens=False)["input_ids"]], max_token_bytes(tokenizer))
        return [AtLeast(n + 1) if isinstance(n, AtLeast) else n + 1 for n in counts]

    return count


def limit_rows(rows: list[dict[str, Any]], limits: dict[str, tuple[int | None, Counter]], action: str = "error",
               source: str = "dataset", row_ids: list[int] | None = None) -> tuple[list[dict[str, Any]], list[int]]:
    """Check rows against token limits: ``limits`` maps a field (``"prompt"``, ``"chosen"``, ...) to (limit or
    None for none, a batch counter ``count(values, limit)``). ``action="error"``: ``UserError`` naming the
    rows over a limit (the first three; as ``row_ids[i]`` when given, e.g. their rows in the file), their
    lengths and the flag to raise; ``"drop"``: (the rows within the limits, the names of those dropped).
    Rows are counted in chunks, so a huge prompt costs one tokenizer call."""
    over: dict[int, tuple[str, int, int]] = {}
    for key, (limit, count) in limits.items():
        if limit is None:
            continue
        for start in range(0, len(rows), 1024):
            chunk = rows[start:start + 1024]
            for j, n in enumerate(count([r[key] for r in chunk], limit)):
                if n > limit and start + j not in over:
                    over[start + j] = (key, n, limit)
    name = (lambda i: row_ids[i]) if row_ids is not None else (lambda i: i)
    if over and (action == "error" or len(over) == len(rows)):
        ids = sorted(over)
        first = "; ".join(f"row {name(i)}: {over[i][0]} has {'at least ' if isinstance(over[i][1], AtLeast) else ''}"
                          f"{over[i][1]} tokens > {over[i][2]}" for i in ids[:3])
        flags = sorted({"--max_prompt_length" if k == "prompt" else "--max_completion_length" for k, _, _ in over.values()})
        hint = "every row is over the limit" if action == "drop" else "or pass --overlong_rows drop to skip them"
        raise UserError(f"{source}: {len(over)} of {len(rows)} rows are too long ({first}{'; ...' if len(ids) > 3 else ''}); "
                        f"raise {' / '.join(flags)} ({hint})")
    return [r for i, r in enumerate(rows) if i not in over], [name(i) for i in sorted(over)]
