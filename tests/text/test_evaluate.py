"""Held-out greedy evaluation of a text policy: several rewards on one decoding, and as a trainer evaluator."""

from __future__ import annotations

from unialign.text import evaluate


class _Policy:
    """Greedy 'generation' that echoes the prompt's last word, counting its calls."""

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, greedy=True):
        self.calls += 1
        return {"texts": [p.split()[-1] for p in prompts]}


def _exact(prompts, completions, answer, **_):
    return [float(c == a) for c, a in zip(completions, answer)]


def _length(prompts, completions, **_):
    return [len(c) for c in completions]


def test_greedy_scores_decode_once_and_match_greedy_score_per_reward():
    rows = [{"prompt": f"say {w}", "answer": a} for w, a in (("ab", "ab"), ("c", "x"), ("def", "def"))]
    policy = _Policy()
    out = evaluate.greedy_scores(policy, rows, {"exact": _exact, "length": _length}, batch_size=2)
    assert policy.calls == 2  # two chunks, one decoding each for both rewards
    assert out == {"exact": 2 / 3, "length": 2.0}
    for name, fn in (("exact", _exact), ("length", _length)):
        assert out[name] == evaluate.greedy_score(_Policy(), rows, fn, batch_size=2)
    assert evaluate.GreedyHeldOut(policy, rows, {"exact": _exact})() == {"exact": 2 / 3}


def test_unscored_samples_leave_the_mean_and_none_scored_is_nan_not_zero():
    import math

    rows = [{"prompt": f"say {w}"} for w in ("a", "bb", "ccc", "dddd")]

    def partial(prompts, completions, **_):
        return [None, float("nan"), 3.0, 5.0]

    out = evaluate.greedy_scores(_Policy(), rows, {"partial": partial, "none": lambda p, c, **_: [None] * len(c)})
    assert out["partial"] == 4.0 and math.isnan(out["none"])
