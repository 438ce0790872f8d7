"""PPO-RLHF (InstructGPT stage 3): value head, GAE, KL to the reference in the per-token reward.

    accelerate launch scripts/ppo_rlhf.py                      # offline: embedded policy + embedded reward model
    accelerate launch scripts/ppo_rlhf.py --preset qwen2.5-0.5b-rm --reward_model_path PATH

The reward model is trained by scripts/train_reward_model.py (run here on first use when missing).
Writes <output_dir>/summary.json with held-out task accuracy and reward-model score before/after.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from unialign.config import exit_on_user_error, parse_config
from unialign.rewards import get_reward
from unialign.text import CausalLMPolicy, evaluate, load_rows
from unialign.text.data import gsm8k_prompts
from unialign.trainers import OnlineConfig, OnlineTrainer, finish_run


@dataclass
class PPOConfig(OnlineConfig):
    preset: str | None = field(default=None, metadata={"help": "qwen2.5-0.5b-rm"})
    config: str | None = field(default=None, metadata={"help": "YAML file of field values"})
    model_name_or_path: str = "embedded"
    reward_model_path: str = field(default="outputs/reward_model/final",
                                   metadata={"help": "trained on first use (embedded) when missing"})
    dataset_name: str = "embedded"
    dataset_config: str | None = "main"
    train_split: str = "train"
    eval_split: str = "test"
    num_eval: int = 256
    eval_batch_size: int = 128
    max_new_tokens: int = 24
    temperature: float = 1.0
    lora_rank: int = 0
    generation_cache: str = field(default="dynamic", metadata={
        "help": "dynamic | static (fixed-size KV cache: transformers compiles decoding with CUDA graphs on GPU)"})
    value_head: str = field(default="shared", metadata={
        "help": "critic: 'shared' (head on the policy backbone), 'separate' (own backbone copy) or a "
                "sequence-classification checkpoint such as the reward model"})
    torch_dtype: str = "float32"
    algorithm: str = "ppo"
    num_generations: int = 1
    prompts_per_step: int = 64
    micro_batch_size: int = 64
    learning_rate: float = 1e-4
    beta: float | None = field(default=0.5, metadata={
        "help": "KL coefficient in the reward; the embedded default needs 0.5 (reward hacking below, see README)"})
    max_steps: int = 40
    num_threads: int | None = 1
    output_dir: str = "outputs/ppo_rlhf"


PRESETS = {
    "qwen2.5-0.5b-rm": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="openai/gsm8k", max_new_tokens=256,
        learning_rate=1e-6, beta=0.05, kl_target=6.0, prompts_per_step=64, micro_batch_size=8, max_steps=300,
        torch_dtype="bfloat16", output_dir="outputs/ppo_qwen"),
}


def main(cfg: PPOConfig) -> dict:
    start = time.time()
    rm_path = Path(cfg.reward_model_path)
    if not rm_path.exists() and cfg.reward_model_path == PPOConfig.reward_model_path:
        print(f"no reward model at {rm_path}: training the embedded one first", flush=True)
        script = Path(__file__).with_name("train_reward_model.py")
        subprocess.run([sys.executable, str(script), "--output_dir", str(rm_path.parent), "--report_to", "none"],
                       check=True)
    train = gsm8k_prompts(load_rows(cfg.dataset_name, cfg.train_split, cfg.dataset_config), "train")
    eval_rows = gsm8k_prompts(load_rows(cfg.dataset_name, cfg.eval_split, cfg.dataset_config), "eval")[:cfg.num_eval]
    policy = CausalLMPolicy.from_pretrained(cfg.model_name_or_path, lora_rank=cfg.lora_rank,
                                            torch_dtype=cfg.torch_dtype, max_new_tokens=cfg.max_new_tokens,
                                            temperature=cfg.temperature, value_head=cfg.value_head,
                                            generation_cache=cfg.generation_cache)
    rm = get_reward("reward_model", path=str(rm_path))
    accuracy = get_reward("math_accuracy")
    trainer = OnlineTrainer(policy, rm, train, cfg)
    rm_before = evaluate.greedy_score(policy, eval_rows, rm, cfg.eval_batch_size)
    acc_before = evaluate.greedy_score(policy, eval_rows, accuracy, cfg.eval_batch_size)
    trainer.train()
    rm_after = evaluate.greedy_score(policy, eval_rows, rm, cfg.eval_batch_size)
    acc_after = evaluate.greedy_score(policy, eval_rows, accuracy, cfg.eval_batch_size)
    summary = {"metric": "accuracy", "before": acc_before, "after": acc_after, "rm_before": rm_before,
               "rm_after": rm_after, "steps": trainer.step, "wall_seconds": time.time() - start,
               "num_eval": len(eval_rows)}
    return finish_run(trainer.acc, cfg, summary, policy.save)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(PPOConfig, presets=PRESETS))
