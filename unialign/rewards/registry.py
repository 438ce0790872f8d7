"""Built-in rewards by name, as a literal dict of ``"module:attribute"`` paths resolved on first use,
so naming a reward never imports open_clip / transformers until that reward is actually built.

Each path names either a reward *class* (a factory: ``get_reward`` instantiates it with the keyword
arguments, and the instance is the reward, e.g. a model-based reward that loads weights in ``__init__``)
or a reward *function* with TRL's signature (the keyword arguments are bound to every call).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from unialign.rewards.base import RewardFunction

REWARDS: dict[str, str] = {
    # text, verifiable (unialign/rewards/math.py)
    "math_accuracy": "unialign.rewards.math:math_accuracy_reward",
    "math_format": "unialign.rewards.math:math_format_reward",
    # text, learned (unialign/rewards/reward_model.py): get_reward("reward_model", path=...)
    "reward_model": "unialign.rewards.reward_model:RewardModelReward",
    # image (unialign/rewards/image.py): classes, instantiated with get_reward's kwargs
    "jpeg_compressibility": "unialign.rewards.image:JpegCompressibilityReward",
    "jpeg_incompressibility": "unialign.rewards.image:JpegIncompressibilityReward",
    "aesthetic": "unialign.rewards.image:AestheticReward",
    "clip_score": "unialign.rewards.image:ClipScoreReward",
    # image, verifiable (unialign/rewards/shapes.py): the embedded shapes world's prompt checker
    "shape_verifier": "unialign.rewards.shapes:ShapeVerifierReward",
    "shape_verifier_partial": "unialign.rewards.shapes:PartialShapeVerifierReward",
}


def resolve(path: str) -> Any:
    """Import ``"package.module:attribute"`` and return the attribute (ValueError on a malformed path)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"reward path must look like 'package.module:attribute', got {path!r}")
    obj = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def get_reward(name: str, **kwargs: Any) -> RewardFunction:
    """The registered reward ``name`` as a ``RewardFunction`` (named ``name``, weight 1).

    A registered class is instantiated with ``kwargs``; a registered function gets ``kwargs`` bound to
    every call (a TypeError here if it does not take them). ``name`` may also be a ``"module:attribute"``
    path to a reward outside the registry. Unknown names raise ValueError listing the registered ones.
    """
    if name in REWARDS:
        path = REWARDS[name]
    elif ":" in name:
        path = name
    else:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARDS)} or pass 'module:attribute'")
    target = resolve(path)
    label = name if name in REWARDS else path.rpartition(".")[2].rpartition(":")[2]
    if inspect.isclass(target):
        return RewardFunction(target(**kwargs), name=label)
    return RewardFunction(target, name=label, kwargs=kwargs)
