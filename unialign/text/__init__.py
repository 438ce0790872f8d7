"""Text modality: the causal-LM policy, fused token log-probs, prompt data and evaluation."""

from unialign.text import evaluate
from unialign.text.data import load_rows
from unialign.text.logprob import token_logprobs
from unialign.text.policy import CausalLMPolicy

__all__ = ["CausalLMPolicy", "evaluate", "load_rows", "token_logprobs"]
