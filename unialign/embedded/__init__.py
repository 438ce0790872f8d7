"""The offline demo worlds the scripts run by default, kept out of the library's core (which never imports
this package): a tiny arithmetic task with its model (``arith``), and a world of captioned synthetic shapes
with a tiny SDXL-architecture model, CLIP and aesthetic head (``shapes_world``), its verifiable reward
(``shape_verifier``), the code that built their weights (``arith.build``, ``shapes_build``; the weights are
in ``assets/``) and the parts the scripts assemble from them (``parts``).

The scripts resolve the word ``"embedded"`` (``NAME``) here: ``--model_name_or_path embedded`` is
``model_path(...)``, the arithmetic data set and its preference pairs are registered by that name in
``unialign.text.data``, and the shape verifier in the reward registry, all when this package is imported::

    from unialign.embedded import load_arith_policy
    policy = load_arith_policy()   # the shipped arithmetic model as a CausalLMPolicy
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unialign.rewards.geneval import GENEVAL_BACKENDS
from unialign.rewards.registry import REWARD_INPUTS, REWARDS
from unialign.text.data import NAMED_DATASETS, NAMED_PAIR_DATASETS

NAME = "embedded"
ARITH_LM_DIR = Path(__file__).resolve().parent / "assets" / "arith_lm"  # = arith.DEFAULT_ASSET_DIR


# arith is imported when first used, so that `python -m unialign.embedded.arith` runs a module not yet imported
# The rows are conversational (TRL's format: the question as a user message), so the policy renders them through
# the chat template the model was trained with; a plain string prompt would be used raw (TRL's rule).
def _user(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _arithmetic_rows(split: str, n: int | None = None) -> list[dict[str, Any]]:
    from unialign.embedded.arith import arithmetic_dataset

    return [{"prompt": _user(r["question"]), "answer": r["answer"]} for r in arithmetic_dataset(split, n=n)]


def _arithmetic_pairs(split: str, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    from unialign.embedded.arith import preference_pairs

    return [{**r, "prompt": _user(r["prompt"])} for r in preference_pairs(split, n=n, seed=seed)]


# image, verifiable (unialign/embedded/shape_verifier.py): the shapes world's prompt checker
REWARDS.setdefault("shape_verifier", "unialign.embedded.shape_verifier:ShapeVerifierReward")
REWARDS.setdefault("shape_verifier_partial", "unialign.embedded.shape_verifier:PartialShapeVerifierReward")
REWARD_INPUTS.update({"shape_verifier": "image", "shape_verifier_partial": "image"})
# GenEval's rules on this world (unialign/embedded/geneval_shapes.py): get_reward("geneval", backend="shapes")
GENEVAL_BACKENDS.setdefault("shapes", "unialign.embedded.geneval_shapes:ShapesDetector")
NAMED_DATASETS.setdefault(NAME, _arithmetic_rows)
NAMED_PAIR_DATASETS.setdefault(NAME, _arithmetic_pairs)


def model_path(name_or_path: str) -> str:
    """``"embedded"`` -> the shipped arithmetic model's folder; anything else unchanged."""
    return str(ARITH_LM_DIR) if name_or_path == NAME else name_or_path


def load_arith_policy(**kwargs: Any):
    """The shipped arithmetic model as a ``CausalLMPolicy`` (``kwargs`` as ``CausalLMPolicy.from_pretrained``)."""
    from unialign.text.policy import CausalLMPolicy

    return CausalLMPolicy.from_pretrained(str(ARITH_LM_DIR), **kwargs)
