"""unialign: align language models and diffusion models with the same RL and preference code.

`import unialign` is light: it pulls in torch only. Text, image, reward and trainer code live in
subpackages that import transformers / diffusers / open_clip / accelerate lazily, where used; the
names below are importable from the top level and load their subpackage on first use::

    from unialign import CausalLMPolicy, OnlineConfig, OnlineTrainer, get_reward

    def brevity(completions, **columns):            # any TRL-style reward: f(prompts, completions, **columns)
        return [-len(c) / 100 for c in completions]

    rows = [{"prompt": "Ann has 12 pens and buys 30 more. How many now?", "answer": "42"}] * 8  # or a datasets.Dataset
    policy = CausalLMPolicy.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct")  # a Hub id or a local folder
    config = OnlineConfig(algorithm="grpo", max_steps=2, prompts_per_step=4, num_generations=4, output_dir="out")
    OnlineTrainer(policy, [get_reward("math_accuracy"), brevity], rows, config).train()
"""

import importlib as _importlib

from unialign.types import PreferenceBatch, Trajectory

__version__ = "0.1.0"

_LAZY = {  # name -> module that defines it
    "CausalLMPolicy": "unialign.text.policy",
    "RewardModel": "unialign.text.reward_model",
    "DiffusionPolicy": "unialign.image.policy",
    "VisionLanguagePolicy": "unialign.vision.policy",
    "vision_rows": "unialign.vision.media",
    "OnlineConfig": "unialign.trainers.online",
    "OnlineTrainer": "unialign.trainers.online",
    "PreferenceConfig": "unialign.trainers.preference",
    "PreferenceTrainer": "unialign.trainers.preference",
    "DPOObjective": "unialign.trainers.preference",
    "PairObjective": "unialign.trainers.preference",
    "BradleyTerryObjective": "unialign.trainers.preference",
    "get_reward": "unialign.rewards",
    "CombinedReward": "unialign.rewards",
    "RewardFunction": "unialign.rewards",
    "load_dataset_rows": "unialign.data",
    "train_eval_rows": "unialign.data",
    "prompt_rows": "unialign.text.data",
    "normalize_pairs": "unialign.text.preference",
    "GRPOConfig": "unialign.trl",
    "SFTConfig": "unialign.trl",
    "SFTTrainer": "unialign.trl",
    "RLOOConfig": "unialign.trl",
    "PPOConfig": "unialign.trl",
    "PPOTrainer": "unialign.trl",
    "RLOOTrainer": "unialign.trl",
    "AsyncGRPOConfig": "unialign.trl",
    "AsyncGRPOTrainer": "unialign.trl",
    "RewardConfig": "unialign.trl",
    "RewardTrainer": "unialign.trl",
    "GRPOTrainer": "unialign.trl",
    "DPOConfig": "unialign.trl",
    "DPOTrainer": "unialign.trl",
    "parse_config": "unialign.config",
    "UserError": "unialign.config",
}

__all__ = ["PreferenceBatch", "Trajectory", "__version__", *_LAZY]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'unialign' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, exactly ``__all__`` (submodules stay importable: ``unialign.text``, ...)."""
    return sorted(__all__)
