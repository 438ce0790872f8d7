"""A trained reward model (``unialign.text.reward_model.RewardModel``) as a TRL-style reward function."""

from __future__ import annotations

from typing import Any


class RewardModelReward:
    """``RewardModelReward(path)(prompts, completions) -> list[float]``: the model's scalar scores."""

    def __init__(self, path: str, batch_size: int = 64, device: str | None = None, chat_template: str = "auto"):
        from unialign.text.reward_model import RewardModel

        self.model = RewardModel.from_pretrained(path, chat_template=chat_template)  # the policy's prompt rendering
        if device is not None:
            self.model.model.to(device)
        self.batch_size = batch_size
        self.__name__ = "reward_model"

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        return self.model.score(prompts, completions, self.batch_size).tolist()
