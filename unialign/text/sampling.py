"""How a text policy samples, as one value: ``SamplingKnobs`` is held by ``CausalLMPolicy.sampling`` and read by
every rollout engine (transformers ``generate``, the low-precision rollout copy, vLLM), as ``SamplerKnobs`` is for
image policies. A new knob is a field here with its two translations (``hf_kwargs``, ``vllm_kwargs``) and its flag
in ``unialign.recipes.args.TextSamplingArgs``.

Greedy decoding (held-out evaluation) ignores every knob but ``max_new_tokens`` and ``stop``. The log-prob a
trainer scores is the model's at ``temperature`` (TRL's convention): top-p, top-k, min-p and the repetition penalty
shape what is sampled, not the density
the loss differentiates; the vLLM engine reports the log-prob of the distribution it sampled from (its
``processed_logprobs`` mode) for the importance-sampling correction.

``stop`` strings end a completion as EOS does, whichever engine sampled it (``stop_lengths``, applied by every
engine to its output): the tokens are kept up to and including the one that completes the first stop string (the
policy is trained to emit it; nothing after it is scored), the text the rewards read ends before it (vLLM's and
OpenAI's ``stop``), and the completion does not count as truncated. transformers ``generate`` is told too
(``stop_strings``), so its sampling ends there; the vLLM engine, which runs without a tokenizer, samples to EOS or
``max_new_tokens`` and is cut afterwards (``vllm_kwargs`` has no ``stop``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class SamplingKnobs:
    """One policy's text sampling settings (checked on construction: a ValueError names the knob)."""

    max_new_tokens: int = 64     # completion limit in tokens (sampling and greedy evaluation)
    temperature: float = 1.0     # > 0
    top_p: float = 1.0           # nucleus mass in (0, 1]; 1: off
    top_k: int = 0               # the k most likely tokens; 0: off
    min_p: float = 0.0           # drop tokens under min_p x the most likely one's probability (Nguyen et al. 2024); 0: off
    stop: tuple[str, ...] = ()   # end a completion at the first of these strings (module docstring); (): off
    repetition_penalty: float = 1.0  # CTRL's penalty on tokens already in the prompt or completion (> 0); 1: off

    def __post_init__(self) -> None:
        if isinstance(self.stop, str) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"sampling: stop={self.stop!r} must be a sequence of non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))  # a list given is held as a tuple (hashable, frozen)
        checks = {"max_new_tokens": self.max_new_tokens >= 1, "temperature": self.temperature > 0,
                  "top_p": 0 < self.top_p <= 1, "top_k": self.top_k >= 0, "min_p": 0 <= self.min_p < 1,
                  "repetition_penalty": self.repetition_penalty > 0}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"sampling: {name}={getattr(self, name)!r} is out of range "
                                 "(max_new_tokens >= 1, temperature > 0, 0 < top_p <= 1, top_k >= 0, 0 <= min_p < 1, "
                                 "repetition_penalty > 0)")

    def with_(self, **changes: Any) -> SamplingKnobs:
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    def hf_kwargs(self, greedy: bool = False) -> dict[str, Any]:
        """transformers ``generate`` keyword arguments, the limit included; temperature, top-p and top-k always
        (overriding a checkpoint's ``generation_config``), min-p and the repetition penalty only when on."""
        out: dict[str, Any] = {"do_sample": not greedy, "max_new_tokens": self.max_new_tokens}
        if self.stop:  # generate needs the tokenizer beside them (``tokenizer=``), which the engine adds
            out["stop_strings"] = list(self.stop)
        if not greedy:
            out.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
            if self.min_p:
                out["min_p"] = self.min_p
            if self.repetition_penalty != 1.0:
                out["repetition_penalty"] = self.repetition_penalty
        return out

    def vllm_kwargs(self, greedy: bool = False) -> dict[str, Any]:
        """``vllm.SamplingParams`` keyword arguments for the same distribution: HF's ``top_k=0`` (off) is vLLM's
        ``-1`` (0 is refused by older versions); greedy is temperature 0 with every filter off. No ``stop``: the
        engine has no tokenizer to match it with (module docstring)."""
        if greedy:
            return {"max_tokens": self.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
        out: dict[str, Any] = {"max_tokens": self.max_new_tokens, "temperature": float(self.temperature),
                               "top_p": float(self.top_p), "top_k": int(self.top_k) if self.top_k > 0 else -1}
        if self.min_p:
            out["min_p"] = float(self.min_p)
        if self.repetition_penalty != 1.0:
            out["repetition_penalty"] = float(self.repetition_penalty)
        return out

    def seeded_kwargs(self, generator: Any) -> dict[str, Any]:
        """transformers ``generate`` keyword arguments that draw the same distribution as ``hf_kwargs()`` from
        ``generator`` (a ``torch.Generator``) instead of torch's global RNG: the greedy search of the Gumbel-max
        trick (argmax of the warped log-probs plus Gumbel noise is a draw from their softmax; Gumbel 1954,
        Maddison et al. 2014), after the warpers transformers applies when it samples, in its order
        (temperature, top-k, top-p, min-p; ``generate`` itself applies the repetition penalty first, greedy or
        not). transformers' multinomial step takes no generator, hence this; a rollout thread that must not
        share the trainer's RNG (async rollouts) samples through it."""
        from transformers import (
            LogitsProcessorList,
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        out = self.hf_kwargs(greedy=True)
        if self.repetition_penalty != 1.0:
            out["repetition_penalty"] = self.repetition_penalty
        warpers = [TemperatureLogitsWarper(self.temperature)] if self.temperature != 1.0 else []
        if self.top_k:
            warpers.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p))
        if self.min_p:
            warpers.append(MinPLogitsWarper(min_p=self.min_p))
        out["logits_processor"] = LogitsProcessorList([*warpers, GumbelNoise(generator)])
        return out


class GumbelNoise:
    """A transformers logits processor adding standard Gumbel noise drawn from ``generator`` to the scores
    (``SamplingKnobs.seeded_kwargs``): their argmax is then a sample of softmax(scores); -inf stays -inf."""

    def __init__(self, generator: Any):
        self.generator = generator

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        u = torch.rand(scores.shape, generator=self.generator, device=scores.device, dtype=torch.float32)
        gumbel = -torch.log(-torch.log(u.clamp(torch.finfo(torch.float32).tiny, 1.0 - 2 ** -24)))
        return scores.float() + gumbel


class DecodeLogProbs:
    """A transformers logits processor that records, at each decoding step, the log-probabilities of the token
    chosen -- log_softmax(scores / ``temperature``), the quantity the trainer computes with a forward pass
    (``CausalLMPolicy._forward``) -- and changes nothing. Placed first in the list, before the warpers; the token
    chosen at step t is known at step t + 1 (the last column of ``input_ids``), so one step's [B, V] log-probs are
    held at a time; ``logp(sequences)`` gathers the last one. Saves the scoring forward over the completions
    where the sampler's own log-probs will do: the behaviour policy of async rollouts, as an inference engine's."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: Any = None  # [B, V] log-probs of the last step
        self.chosen: list[Any] = []  # [B, 1] per step

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self.previous is not None:
            self.chosen.append(self.previous.gather(-1, input_ids[:, -1:]))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def logp(self, sequences: Any) -> Any:
        """[B, T]: the log-probs of the T generated tokens, the last columns of ``sequences`` [B, W + T]."""
        import torch

        steps = [*self.chosen, self.previous.gather(-1, sequences[:, -1:])] if self.previous is not None else []
        return torch.cat(steps, dim=1) if steps else sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def parse_stop(text: str | None) -> tuple[str, ...]:
    """The stop strings a ``--stop`` value names: a JSON list of strings (``'["\\n\\n", "Question:"]'``), else one
    string in which ``\\n``, ``\\t``, ``\\r`` and ``\\\\`` are the characters they stand for (a newline typed on a
    command line); None or "": none. ValueError for a list that does not read or holds anything but non-empty
    strings."""
    if not text:
        return ()
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{text!r} is not a JSON list of strings ({err.msg})") from None
        if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
            raise ValueError(f"{text!r} must be a JSON list of non-empty strings")
        return tuple(items)
    return (re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text),)


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the first of ``stop`` begins in ``text`` (the earliest occurrence of any), or None."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def stop_lengths(rows: Sequence[Sequence[int]], decode: Callable[[Sequence[int]], str],
                 stop: Sequence[str]) -> list[int | None]:
    """For each row of kept completion token ids, how many tokens it keeps under ``stop``: up to and including
    the token whose text completes the first stop string (the shortest prefix whose ``decode`` holds one, found
    by bisection: a prefix's text is a prefix of the longer one's), or None when its text holds none."""
    out: list[int | None] = []
    for ids in rows:
        ids = list(ids)
        if not stop or first_stop(decode(ids), stop) is None:
            out.append(None)
            continue
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if first_stop(decode(ids[:mid]), stop) is None:
                lo = mid + 1
            else:
                hi = mid
        out.append(lo)
    return out
