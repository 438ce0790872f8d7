"""How a text policy samples, as one value: ``SamplingKnobs`` is held by ``CausalLMPolicy.sampling`` and read by
every rollout engine (transformers ``generate``, the low-precision rollout copy, vLLM), as ``SamplerKnobs`` is for
image policies. A new knob is a field here with its two translations (``hf_kwargs``, ``vllm_kwargs``) and its flag
in ``unialign.recipes.text.TextSamplingArgs``.

Greedy decoding (held-out evaluation) ignores every knob but ``max_new_tokens``. The log-prob a trainer scores is
the model's at ``temperature`` (TRL's convention): top-p, top-k and min-p shape what is sampled, not the density
the loss differentiates; the vLLM engine reports the log-prob of the distribution it sampled from (its
``processed_logprobs`` mode) for the importance-sampling correction.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        checks = {"max_new_tokens": self.max_new_tokens >= 1, "temperature": self.temperature > 0,
                  "top_p": 0 < self.top_p <= 1, "top_k": self.top_k >= 0, "min_p": 0 <= self.min_p < 1}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"sampling: {name}={getattr(self, name)!r} is out of range "
                                 "(max_new_tokens >= 1, temperature > 0, 0 < top_p <= 1, top_k >= 0, 0 <= min_p < 1)")

    def with_(self, **changes: Any) -> SamplingKnobs:
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    def hf_kwargs(self, greedy: bool = False) -> dict[str, Any]:
        """transformers ``generate`` keyword arguments, the limit included; temperature, top-p and top-k always
        (overriding a checkpoint's ``generation_config``), min-p only when on."""
        out: dict[str, Any] = {"do_sample": not greedy, "max_new_tokens": self.max_new_tokens}
        if not greedy:
            out.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
            if self.min_p:
                out["min_p"] = self.min_p
        return out

    def vllm_kwargs(self, greedy: bool = False) -> dict[str, Any]:
        """``vllm.SamplingParams`` keyword arguments for the same distribution: HF's ``top_k=0`` (off) is vLLM's
        ``-1`` (0 is refused by older versions); greedy is temperature 0 with every filter off."""
        if greedy:
            return {"max_tokens": self.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
        out: dict[str, Any] = {"max_tokens": self.max_new_tokens, "temperature": float(self.temperature),
                               "top_p": float(self.top_p), "top_k": int(self.top_k) if self.top_k > 0 else -1}
        if self.min_p:
            out["min_p"] = float(self.min_p)
        return out
