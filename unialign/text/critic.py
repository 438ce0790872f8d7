"""PPO's critic for ``CausalLMPolicy`` (``value_head``), in three flavours.

``True`` / ``"shared"``: a zero-initialised scalar head on the policy's backbone (its last hidden state);
``"separate"``: a critic with its own copy of the backbone (``ValueModel``); any other string: a
sequence-classification checkpoint (e.g. the reward model, as InstructGPT initialises its value model)
whose backbone and score head become the critic. Either is attached to the policy's module
(``CRITIC_MODULES``), so the trainer's optimizer and wrapper see it; the reference, the saved model and the
vLLM engine leave it out (``detached_critics``).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from unialign.hub import hub_error, require_hub
from unialign.weights import check_finite

CRITIC_MODULES = ("value_head", "value_model")


def attach_critic(base: torch.nn.Module, value_head: bool | str,
                  device: torch.device) -> tuple[torch.nn.Module | None, ValueModel | None]:
    """``(value_head, value_model)`` for the policy's ``value_head`` setting, one of them or neither
    (``False``), hung on ``base`` (the causal-LM module, without wrappers) unless it already carries one; a
    shared head is made on ``device``."""
    if not value_head:
        return None, None
    if value_head in (True, "shared"):
        if not hasattr(base, "value_head"):
            base.value_head = _zero_linear(base.config.get_text_config().hidden_size, device)  # a VLM's: its LM's
        return base.value_head, None
    if not hasattr(base, "value_model"):
        base.value_model = ValueModel.build(base, value_head)
    return None, base.value_model


@contextlib.contextmanager
def detached_critics(base: torch.nn.Module):
    """Temporarily remove the critic submodules from ``base`` (yields them by name)."""
    critics = {name: base._modules.pop(name) for name in CRITIC_MODULES if name in base._modules}
    try:
        yield critics
    finally:
        for name, module in critics.items():
            setattr(base, name, module)


def _zero_linear(hidden: int, device) -> torch.nn.Linear:
    head = torch.nn.Linear(hidden, 1, device=device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head


class ValueModel(torch.nn.Module):
    """A separate PPO critic: a transformer backbone and a scalar head, V [B, L] per position."""

    def __init__(self, body: torch.nn.Module, head: torch.nn.Module):
        super().__init__()
        self.body, self.head = body, head

    @classmethod
    def build(cls, policy_base: torch.nn.Module, source: str) -> ValueModel:
        """``"separate"``: a copy of the policy's backbone with a zero head; else load ``source`` as a
        one-label sequence-classification checkpoint and take its backbone and score head."""
        if source == "separate":  # the decoder holds no critic: those sit on the causal-LM wrapper
            body = copy.deepcopy(policy_base.get_decoder())
            device = next(body.parameters()).device
            return cls(body.requires_grad_(True), _zero_linear(policy_base.config.hidden_size, device))
        from transformers import AutoModelForSequenceClassification

        require_hub(source, "model")
        param = next(policy_base.parameters())
        try:
            seq = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=param.dtype)
        except (OSError, ValueError) as err:
            raise hub_error(source, err) from None
        check_finite(seq, source, "value head")
        if seq.config.vocab_size != policy_base.config.vocab_size:
            raise ValueError(f"value_head={source!r}: its vocabulary ({seq.config.vocab_size}) is not the "
                             f"policy's ({policy_base.config.vocab_size}); the critic must read the policy's "
                             "token ids")
        head = next((getattr(seq, n) for n in ("score", "classifier") if getattr(seq, n, None) is not None),
                    None)
        if head is None:
            raise ValueError(f"value_head={source!r}: no 'score' / 'classifier' head on {type(seq).__name__}")
        return cls(getattr(seq, seq.base_model_prefix), head).to(param.device)

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1)
