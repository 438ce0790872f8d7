"""One huge input costs no more than refusing it: a prompt, a completion or a VLM prompt too long for its token limit
even at the tokenizer's longest token is refused without being tokenized (a 40 M-character prompt took 207 s and
16 GB before its refusal; 400 M characters were OOM-killed)."""

from __future__ import annotations

import pytest

from unialign.config import UserError
from unialign.text.data import (
    AtLeast,
    completion_token_counter,
    limit_rows,
    max_token_bytes,
    prompt_token_counter,
)


def _spy(tokenizer, monkeypatch):
    """Record the longest text the tokenizer is asked to encode."""
    seen = [0]
    cls = type(tokenizer)
    real = cls.__call__

    def call(self, text, *a, **kw):
        texts = [text] if isinstance(text, str) else list(text)
        seen[0] = max([seen[0], *(len(t) for t in texts)])
        return real(self, text, *a, **kw)

    monkeypatch.setattr(cls, "__call__", call)
    return seen


def test_a_huge_prompt_is_refused_without_tokenizing_it(tiny_policy, monkeypatch):
    seen = _spy(tiny_policy.tokenizer, monkeypatch)
    rows = [{"prompt": "2+2?"}, {"prompt": "x" * 4_000_000}, {"prompt": "y" * 600}]
    limits = {"prompt": (512, prompt_token_counter(tiny_policy))}
    with pytest.raises(UserError, match=r"row 1: prompt has at least \d+ tokens > 512; row 2: prompt has 6\d\d tokens"):
        limit_rows(rows, limits)
    assert seen[0] < 10_000  # only the 600-character prompt (with its template) was tokenized
    kept, dropped = limit_rows(rows, limits, action="drop")
    assert kept == rows[:1] and dropped == [1, 2]


def test_a_huge_completion_is_refused_without_tokenizing_it(tiny_policy, monkeypatch):
    seen = _spy(tiny_policy.tokenizer, monkeypatch)
    counts = completion_token_counter(tiny_policy.tokenizer)(["4", "z" * 4_000_000], 64)
    assert isinstance(counts[1], AtLeast) and counts[1] > 64 and counts[0] <= 64
    assert seen[0] < 10_000


def test_the_lower_bound_never_refuses_a_prompt_that_fits(tiny_policy):
    """At the bound's edge: a text exactly as long as limit x the longest token in bytes is tokenized, not guessed."""
    per = max_token_bytes(tiny_policy.tokenizer)
    assert per >= 4 * max(len(t.encode()) for t in tiny_policy.tokenizer.get_vocab())
    count = prompt_token_counter(tiny_policy)
    n = count(["a" * 500], 512)[0]
    assert not isinstance(n, AtLeast) and n > 500


def test_a_huge_vlm_prompt_is_refused_without_processing_it(monkeypatch):
    from tests.vision.tiny import build
    from unialign.vision.policy import VisionLanguagePolicy

    model, processor = build("qwen2_vl")
    policy = VisionLanguagePolicy(model, processor, max_new_tokens=4)
    calls = []
    monkeypatch.setattr(policy, "_encode_row", lambda i, p: calls.append(i) or (_ for _ in ()).throw(AssertionError))
    huge = [{"role": "user", "content": [{"type": "text", "text": "w" * 4_000_000}]}]
    (n,) = policy.count_prompt_tokens([huge], 256)
    assert isinstance(n, AtLeast) and n > 256 and calls == []
