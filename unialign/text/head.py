"""An output head that turns the causal LM's forward into a memory-lean log-prob pass.

``FusedLogprobHead`` takes over the model's ``lm_head`` parameters (same ``weight`` object, so tied
embeddings stay tied and ``save_pretrained`` keys are unchanged). Outside ``targets(...)`` it is a
plain linear layer, so ``generate`` is untouched. Inside, its forward returns per-position
``[log p(target), entropy]`` computed by ``token_logprobs`` without materialising [B, T, V] logits.
Because the work happens inside the model's own forward, it runs through DDP / FSDP / ZeRO-3
wrappers like any other layer.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from unialign.text.logprob import token_logprobs


class FusedLogprobHead(torch.nn.Module):
    def __init__(self, head: torch.nn.Linear, chunk_size: int = 1024):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.in_features, self.out_features = head.in_features, head.out_features
        self.chunk_size = chunk_size
        self._targets: torch.Tensor | None = None
        self._temperature = 1.0

    @contextlib.contextmanager
    def targets(self, tokens_B_K: torch.Tensor, temperature: float = 1.0):
        """Within this context, forward(hidden_B_K_H) returns [B, K, 2] = (log-prob of tokens_B_K, entropy)."""
        self._targets, self._temperature = tokens_B_K, temperature
        try:
            yield
        finally:
            self._targets = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._targets is None:
            return F.linear(hidden, self.weight, self.bias)
        logp, entropy = token_logprobs(hidden, self.weight, self._targets, bias_V=self.bias,
                                       temperature=self._temperature, chunk_size=self.chunk_size, with_entropy=True)
        return torch.stack([logp, entropy], dim=-1)


def install_fused_head(model: torch.nn.Module, chunk_size: int = 1024) -> FusedLogprobHead:
    """Replace ``model``'s output embeddings by a ``FusedLogprobHead`` sharing its parameters (idempotent)."""
    head = model.get_output_embeddings()
    if isinstance(head, FusedLogprobHead):
        return head
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"expected a Linear output head, found {type(head).__name__}")
    fused = FusedLogprobHead(head, chunk_size)
    model.set_output_embeddings(fused)
    return fused
