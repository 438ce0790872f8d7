"""Bradley-Terry reward model: a scalar head on a causal-LM backbone trained on preference pairs.

    accelerate launch scripts/train_reward_model.py          # offline: embedded model, correct vs wrong answers
    accelerate launch scripts/train_reward_model.py --preset qwen2.5-0.5b-ultrafeedback

Writes <output_dir>/summary.json (held-out pairwise accuracy before/after) and <output_dir>/final, a
stock ``*ForSequenceClassification`` checkpoint usable as ``get_reward("reward_model", path=...)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from accelerate.utils import set_seed

from unialign.config import exit_on_user_error, parse_config
from unialign.text import load_rows
from unialign.text.embedded import preference_pairs
from unialign.text.preference import normalize_pairs
from unialign.text.reward_model import RewardModel
from unialign.trainers import finish_run
from unialign.trainers.preference import BradleyTerryObjective, PreferenceConfig, PreferenceTrainer


@dataclass
class RewardModelConfig(PreferenceConfig):
    preset: str | None = field(default=None, metadata={"help": "qwen2.5-0.5b-ultrafeedback"})
    config: str | None = field(default=None, metadata={"help": "YAML file of field values"})
    model_name_or_path: str = "embedded"
    dataset_name: str = field(default="embedded", metadata={"help": "hub id, .json/.jsonl/.parquet, or 'embedded'"})
    dataset_config: str | None = None
    train_split: str = "train"
    eval_split: str = "test"
    num_eval: int = 256
    center_coef: float = 0.01
    max_length: int | None = None
    torch_dtype: str = "float32"
    batch_size: int = 32
    micro_batch_size: int = 32
    learning_rate: float = 1e-3
    max_steps: int = 150
    num_threads: int | None = 1
    output_dir: str = "outputs/reward_model"


PRESETS = {
    "qwen2.5-0.5b-ultrafeedback": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="trl-lib/ultrafeedback_binarized",
        learning_rate=1e-5, batch_size=32, micro_batch_size=4, max_steps=1000, max_length=1024,
        torch_dtype="bfloat16", output_dir="outputs/rm_qwen_ultrafeedback"),
}


def main(cfg: RewardModelConfig) -> dict:
    start = time.time()
    set_seed(cfg.seed)  # the new score head is initialised below
    if cfg.dataset_name == "embedded":
        train = preference_pairs("train", seed=cfg.seed)
        held_out = preference_pairs("test", n=cfg.num_eval, seed=cfg.seed + 1)
    else:
        train = load_rows(cfg.dataset_name, cfg.train_split, cfg.dataset_config)
        held_out = load_rows(cfg.dataset_name, cfg.eval_split, cfg.dataset_config)[:cfg.num_eval]
    train, held_out = normalize_pairs(train, "train"), normalize_pairs(held_out, "eval")
    rm = RewardModel.from_pretrained(cfg.model_name_or_path, torch_dtype=cfg.torch_dtype, max_length=cfg.max_length)
    trainer = PreferenceTrainer(BradleyTerryObjective(rm, cfg.center_coef), train, cfg)
    before = trainer.evaluate(held_out)["accuracy"]
    trainer.train()
    after = trainer.evaluate(held_out)["accuracy"]
    summary = {"metric": "pairwise_accuracy", "before": before, "after": after, "steps": trainer.step,
               "wall_seconds": time.time() - start, "num_eval_pairs": len(held_out)}
    return finish_run(trainer.acc, cfg, summary, rm.save)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(RewardModelConfig, presets=PRESETS))
