"""A learned reward model: a causal-LM backbone with a scalar sequence-classification head.

Trained with ``algos.bradley_terry_loss`` by the pairwise loop, and usable as a reward in the online
trainer through ``unialign.rewards.reward_model.RewardModelReward``. The score is read at the last
real token of ``prompt + completion + EOS`` (transformers' ``*ForSequenceClassification`` convention), so
padding on either side is fine; the prompt as the policy renders it (TRL's rule, ``chat_template="auto"``: a
conversation through the chat template, a string raw; see ``CausalLMPolicy``).
"""

from __future__ import annotations

from typing import Any

import torch

from unialign.dist import unwrap
from unialign.hub import hub_error, require_hub
from unialign.text.preference import completion_text
from unialign.text.prompts import CHAT_TEMPLATE_MODES, messages_text, templated
from unialign.text.tokens import encode_prompts
from unialign.types import PreferenceBatch
from unialign.weights import check_finite


class RewardModel:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int | None = None,
                 chat_template: str = "auto"):
        if chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {chat_template!r}")
        self.model, self.tokenizer, self.max_length, self.chat_template = model, tokenizer, max_length, chat_template
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        unwrap(model).config.pad_token_id = tokenizer.pad_token_id

    @classmethod
    def from_pretrained(cls, name_or_path: str, trust_remote_code: bool = False, torch_dtype: str = "float32",
                        gradient_checkpointing: bool = False, **kwargs) -> RewardModel:
        """A sequence-classification model with one label; from a causal-LM checkpoint the head is new;
        ``gradient_checkpointing``: activations recomputed in the backward pass (transformers', non-reentrant)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        require_hub(name_or_path, "model")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
            model = AutoModelForSequenceClassification.from_pretrained(
                name_or_path, num_labels=1, dtype=getattr(torch, torch_dtype), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise hub_error(name_or_path, err) from None
        check_finite(model, name_or_path)
        if gradient_checkpointing:
            from unialign.text.policy import checkpoint_activations

            checkpoint_activations(model)
        return cls(model, tokenizer, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(unwrap(self.model).parameters()).device

    def _text(self, prompt: Any, completion: Any) -> str:
        text = completion_text(completion)
        if templated(self.chat_template, prompt):
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise ValueError("a conversational prompt needs a chat template, and the reward model's tokenizer "
                                 "has none: pass --chat_template never to use the messages' text raw")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            prefix = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            prefix = prompt if isinstance(prompt, str) else messages_text(prompt)
        return prefix + text + self.tokenizer.eos_token

    def encode(self, prompts: list[Any], completions: list[Any]) -> dict[str, torch.Tensor]:
        """Left-padded ids and mask [B, L] of prompt + completion + EOS; a raw-text prompt starts with the
        tokenizer's special prefix (BOS where it adds one), a chat-templated one with the template's own
        (``unialign.text.tokens``)."""
        enc = encode_prompts(self.tokenizer, [self._text(p, c) for p, c in zip(prompts, completions)],
                             [templated(self.chat_template, p) for p in prompts], max_length=self.max_length,
                             padding_side="left")
        return {k: v.to(self.device) for k, v in enc.items()}

    def _scores(self, enc: dict[str, torch.Tensor]) -> torch.Tensor:
        # position ids follow the attention mask (left padding), as in generation and the policy
        position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return self.model(**enc, position_ids=position_ids).logits.squeeze(-1).float()

    @torch.no_grad()
    def score(self, prompts: list[Any], completions: list[Any], batch_size: int = 64) -> torch.Tensor:
        """Scalar rewards [B] of prompt/completion pairs (no gradient)."""
        was = unwrap(self.model).training
        self.model.eval()
        out = torch.cat([self._scores(self.encode(prompts[i:i + batch_size], completions[i:i + batch_size])).cpu()
                         for i in range(0, len(prompts), batch_size)])
        self.model.train(was)
        return out

    def preference_batch(self, rows: list[dict[str, Any]]) -> PreferenceBatch:
        prompts = [r["prompt"] for r in rows]
        margin = torch.tensor([r["margin"] for r in rows]) if all("margin" in r for r in rows) else None
        return PreferenceBatch(prompts=prompts, chosen=self.encode(prompts, [r["chosen"] for r in rows]),
                               rejected=self.encode(prompts, [r["rejected"] for r in rows]), margin_B=margin)

    def pair_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable (chosen_B, rejected_B) scores."""
        return self._scores(batch.chosen), self._scores(batch.rejected)

    def trainable_parameters(self):
        return [p for p in unwrap(self.model).parameters() if p.requires_grad]

    def save(self, path: str) -> None:
        """Called on every process (FSDP2 shards gathered); the main process writes."""
        from unialign.dist import fsdp2_root, gathered_state_dict, is_main_rank

        model = unwrap(self.model)
        state = gathered_state_dict(model) if fsdp2_root(model) is not None else None
        if not is_main_rank():
            return
        model.save_pretrained(path, **({"state_dict": state} if state is not None else {}))
        self.tokenizer.save_pretrained(path)
