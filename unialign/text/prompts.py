"""Prompt encoding for ``CausalLMPolicy``: a prompt (a string or a list of chat messages) as the text the
model is conditioned on, and a batch of them as left-padded ids and mask.

``chat_template`` follows TRL's rule: ``"auto"``: a string prompt (TRL's standard format) is used raw, a
list of messages (conversational) goes through the tokenizer's chat template; ``"always"``: a string is sent
as one user message through the template too (after the system prompt); ``"never"``: no template, a
conversation's message contents joined by blank lines. A conversation with a tokenizer that has no chat
template is a ``ValueError`` naming ``chat_template``.
"""

from __future__ import annotations

from typing import Any

import torch

from unialign.text.tokens import encode_prompts

CHAT_TEMPLATE_MODES = ("auto", "always", "never")


def templated(mode: str, prompt: Any) -> bool:
    """TRL's rule for ``mode`` "auto" (a conversation through the chat template, a string raw), or always /
    never."""
    return mode == "always" or (mode == "auto" and not isinstance(prompt, str))


def messages_text(messages: list[dict[str, Any]]) -> str:
    """A conversation without a template: its messages' text contents joined by blank lines."""
    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "\n\n".join(text(m["content"]) for m in messages)


class PromptEncoder:
    """The tokenizer and the prompt settings (``chat_template``, ``system_prompt``, ``max_prompt_length``).
    Builds with the tokenizer set up for generation: EOS as the pad token when it has none, left padding."""

    def __init__(self, tokenizer: Any, chat_template: str = "auto", system_prompt: str | None = None,
                 max_prompt_length: int | None = None):
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        if chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, "
                             f"got {chat_template!r}")
        self.tokenizer, self.chat_template, self.system_prompt = tokenizer, chat_template, system_prompt
        self.max_prompt_length = max_prompt_length

    def is_templated(self, prompt: Any) -> bool:
        """Whether ``format_prompt`` renders ``prompt`` through the chat template (which carries the BOS
        the model wants) rather than as raw text (which gets the tokenizer's own,
        ``unialign.text.tokens``)."""
        return templated(self.chat_template, prompt)

    def format_prompt(self, prompt: Any) -> str:
        """A string prompt, or a list of chat messages, as the text the model is conditioned on."""
        if not self.is_templated(prompt):
            return prompt if isinstance(prompt, str) else messages_text(prompt)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("a conversational prompt (a list of messages) needs a chat template, and the "
                             "model's tokenizer has none: pass --chat_template never to use the messages' "
                             "text raw")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if self.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, prompts: list[Any], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Left-padded prompt ids and mask [B, W] on ``device``, special tokens as the model expects them
        (``unialign.text.tokens.encode_prompts``: BOS on raw text where the tokenizer adds one, none
        added to a chat template's output), at most ``max_prompt_length`` tokens when set."""
        enc = encode_prompts(self.tokenizer, [self.format_prompt(p) for p in prompts],
                             [self.is_templated(p) for p in prompts], max_length=self.max_prompt_length,
                             padding_side="left")
        return {k: v.to(device) for k, v in enc.items()}
