"""Rewards: the TRL-compatible reward contract, a weighted combinator and built-in rewards by name.
Importing this package pulls in torch only; model-based rewards import their libraries when built.
"""

from unialign.rewards.base import (
    CombinedReward,
    RewardError,
    RewardFunction,
    RewardOutput,
    RewardTimeoutError,
    completion_to_text,
    get_reward,
)
from unialign.rewards.registry import REWARDS

__all__ = ["REWARDS", "CombinedReward", "RewardError", "RewardFunction", "RewardOutput", "RewardTimeoutError",
           "completion_to_text", "get_reward"]
