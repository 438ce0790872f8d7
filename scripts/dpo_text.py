"""DPO (sigmoid / IPO / hinge / robust-cDPO) on text preference pairs.

    accelerate launch scripts/dpo_text.py                     # offline: embedded arithmetic model, correct vs wrong answers
    accelerate launch scripts/dpo_text.py --preset qwen2.5-0.5b-ultrafeedback

Writes <output_dir>/summary.json: task accuracy of fresh greedy samples before/after (embedded task),
held-out implicit accuracy before/after and the first logged loss; loss_curve.png; checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from unialign.config import exit_on_user_error, parse_config
from unialign.rewards import get_reward
from unialign.text import CausalLMPolicy, evaluate, load_rows
from unialign.text.data import gsm8k_prompts
from unialign.text.embedded import preference_pairs
from unialign.text.preference import normalize_pairs
from unialign.trainers import finish_run
from unialign.trainers.preference import DPOObjective, PreferenceConfig, PreferenceTrainer, fingerprint


@dataclass
class DPOTextConfig(PreferenceConfig):
    preset: str | None = field(default=None, metadata={"help": "qwen2.5-0.5b-ultrafeedback"})
    config: str | None = field(default=None, metadata={"help": "YAML file of field values"})
    model_name_or_path: str = "embedded"
    dataset_name: str = field(default="embedded", metadata={"help": "hub id, .json/.jsonl/.parquet, or 'embedded'"})
    dataset_config: str | None = None
    train_split: str = "train"
    eval_split: str = "test"
    num_eval: int = 256
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float | None = field(default=1.0, metadata={
        "help": "weight of the chosen-side NLL (RPO); plain DPO lowers the embedded task's accuracy, see README"})
    lora_rank: int = 0
    torch_dtype: str = "float32"
    precompute_ref_log_probs: bool = False
    max_new_tokens: int = 24
    batch_size: int = 32
    micro_batch_size: int = 32
    learning_rate: float = 2e-4
    max_steps: int = 60
    num_threads: int | None = 1
    output_dir: str = "outputs/dpo_text"


PRESETS = {
    "qwen2.5-0.5b-ultrafeedback": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="trl-lib/ultrafeedback_binarized",
        beta=0.1, rpo_alpha=None, learning_rate=5e-7, batch_size=64, micro_batch_size=4, max_steps=1000, torch_dtype="bfloat16",
        warmup_steps=50, num_eval=512, output_dir="outputs/dpo_qwen_ultrafeedback"),
}


def main(cfg: DPOTextConfig) -> dict:
    start = time.time()
    embedded = cfg.dataset_name == "embedded"
    if embedded:  # correct vs wrong final answers on the embedded arithmetic task
        eval_raw = load_rows("embedded", "test")[:cfg.num_eval]
        train = preference_pairs("train", seed=cfg.seed)
        held_out = preference_pairs("test", n=cfg.num_eval, seed=cfg.seed + 1)
    else:
        train = load_rows(cfg.dataset_name, cfg.train_split, cfg.dataset_config)
        held_out = load_rows(cfg.dataset_name, cfg.eval_split, cfg.dataset_config)[:cfg.num_eval]
    train, held_out = normalize_pairs(train, "train"), normalize_pairs(held_out, "eval")
    policy = CausalLMPolicy.from_pretrained(cfg.model_name_or_path, lora_rank=cfg.lora_rank,
                                            torch_dtype=cfg.torch_dtype, max_new_tokens=cfg.max_new_tokens)
    objective = DPOObjective(policy, cfg.beta, cfg.loss_type, cfg.label_smoothing,
                             cache_reference=cfg.precompute_ref_log_probs, rpo_alpha=cfg.rpo_alpha)
    if cfg.precompute_ref_log_probs:
        key = fingerprint(train, policy.model)
        objective.precompute(train, cfg.eval_batch_size, Path(cfg.output_dir) / f"ref_cache-{key}.pt")
    trainer = PreferenceTrainer(objective, train, cfg)

    def task_accuracy() -> float | None:
        if not embedded:
            return None
        rows = gsm8k_prompts(eval_raw, "eval")
        return evaluate.greedy_score(policy, rows, get_reward("math_accuracy"), cfg.eval_batch_size)

    acc_before, implicit_before = task_accuracy(), trainer.evaluate(held_out)["implicit_accuracy"]
    history = trainer.train()
    acc_after, implicit_after = task_accuracy(), trainer.evaluate(held_out)["implicit_accuracy"]
    summary = {"metric": "accuracy" if embedded else "implicit_accuracy",
               "before": acc_before if embedded else implicit_before,
               "after": acc_after if embedded else implicit_after,
               "implicit_accuracy_before": implicit_before, "implicit_accuracy_after": implicit_after,
               "first_loss": history[0]["loss"] if history else None,
               "first_nll_loss": history[0].get("nll_loss") if history else None, "steps": trainer.step,
               "wall_seconds": time.time() - start, "num_eval_pairs": len(held_out)}
    return finish_run(trainer.acc, cfg, summary, policy.save)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(DPOTextConfig, presets=PRESETS))
