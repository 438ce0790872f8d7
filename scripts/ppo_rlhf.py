"""PPO-RLHF (InstructGPT stage 3): value head, GAE, KL to the reference in the per-token reward.

    accelerate launch scripts/ppo_rlhf.py                      # offline: embedded policy + embedded reward model
    accelerate launch scripts/ppo_rlhf.py --preset qwen2.5-0.5b-rm --reward_model_path PATH

Without --reward_model_path the embedded reward model is trained by scripts/train_reward_model.py into
<output_dir>/reward_model on first use (--reward_model_steps steps; a killed one is resumed, a finished one
reused). Prompts in TRL's formats or GSM8K's schema (a Hub id, a file or a folder of split files). Writes only
under <output_dir>: summary.json with held-out task accuracy (rows with an 'answer') and reward-model score
before/after, completions.jsonl (held-out samples at every evaluation), curves, logs, checkpoints, final/.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from unialign.config import arg, default, exit_on_user_error, parse_config
from unialign.embedded import NAME, check_model_kind, model_path, register
from unialign.embedded.args import EmbeddedTaskArgs, tuned_for
from unialign.recipes import presets
from unialign.recipes.args import (
    GenerationCacheArgs,
    RunArgs,
    SystemPromptArgs,
    TextModelArgs,
    TextRLArgs,
)
from unialign.recipes.outputs import finish_run
from unialign.recipes.text import TextDataArgs, columns_of, fit_prompts, load_prompt_data, reward_model_folder
from unialign.rewards import get_reward
from unialign.text import CausalLMPolicy, evaluate
from unialign.trainers import OnlineConfig, OnlineTrainer

PRESETS = presets.PPO_RLHF


@dataclass
class PPOConfig(EmbeddedTaskArgs, RunArgs, TextRLArgs, GenerationCacheArgs, SystemPromptArgs, TextModelArgs, TextDataArgs,
                OnlineConfig):
    PRESETS: ClassVar[dict] = PRESETS
    # measured on the shipped model (docs/text.md), for it only; any other model starts from the Qwen preset's values
    # (TRL's PPO lives in trl.experimental, whose defaults are not a stable reference)
    MODEL_DEFAULTS: ClassVar[dict] = tuned_for((NAME,), dict(
        max_new_tokens=24, prompts_per_step=64, micro_batch_size=64, learning_rate=1e-4, beta=0.5, eval_batch_size=128,
        num_threads=1))
    reward_model_path: str | None = arg(None, "reward-model checkpoint (unset: the embedded one, trained on first use "
                                        "into <output_dir>/reward_model)", group="model")
    reward_model_steps: int | None = arg(None, "optimizer steps of the embedded reward model when it is trained here "
                                         "(unset: train_reward_model.py's default)", group="optimisation", min=1)
    eval_batch_size: int = arg(64, "prompts per greedy-evaluation batch", group="logging", min=1)
    max_new_tokens: int = default(256)
    value_head: str = arg("shared", "critic: 'shared' (head on the policy backbone), 'separate' (own backbone copy) or "
                          "a sequence-classification checkpoint such as the reward model", group="model")
    algorithm: str = default("ppo")
    num_generations: int = default(1)
    learning_rate: float = default(1e-6)
    beta: float | None = arg(0.05, "KL coefficient in the reward (the embedded model needs 0.5: reward hacking "
                             "below it, docs/text.md)")
    max_steps: int = default(40)
    output_dir: str = default("outputs/ppo_rlhf")


def main(cfg: PPOConfig) -> dict:
    register()  # the demo worlds by name: data set 'embedded', the shape verifiers, GenEval's 'shapes' backend
    check_model_kind(cfg.model_name_or_path, ("text",))  # a model of another kind: one line, now
    start = time.time()
    train, eval_rows, data_info = load_prompt_data(cfg)
    rm_path = reward_model_folder(cfg, Path(__file__).with_name("train_reward_model.py"))
    cfg.reward_model_path = str(rm_path)  # the config recorded (summary.json, trackers) names the model used
    # a bad reward-model path fails before the policy loads; the RM renders prompts as the policy does
    rm = get_reward("reward_model", path=str(rm_path), chat_template=cfg.chat_template)
    policy = CausalLMPolicy.from_pretrained(
        model_path(cfg.model_name_or_path), **cfg.model_kwargs(),
        sampling=cfg.sampling(), value_head=cfg.value_head, system_prompt=cfg.system_prompt,
        generation_cache=cfg.generation_cache, chat_template=cfg.chat_template)
    train, eval_rows = fit_prompts(policy, train, eval_rows, cfg, data_info)  # before any forward
    accuracy = get_reward("math_accuracy") if {"answer", "solution"} & columns_of(eval_rows) else None
    scorers = {"rm_score": rm, **({"accuracy": accuracy} if accuracy else {})}
    held_out = evaluate.GreedyHeldOut(policy, eval_rows, scorers, cfg.eval_batch_size)
    trainer = OnlineTrainer(policy, rm, train, cfg, evaluator=held_out)  # eval/* every eval_steps
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    rm_before, rm_after = before["eval/rm_score"], after["eval/rm_score"]
    acc_before, acc_after = before.get("eval/accuracy"), after.get("eval/accuracy")
    summary = {"metric": "accuracy" if accuracy else "rm_score", "before": acc_before if accuracy else rm_before,
               "after": acc_after if accuracy else rm_after, "rm_before": rm_before, "rm_after": rm_after,
               "steps": trainer.step, "wall_seconds": time.time() - start, "num_eval": len(eval_rows), **data_info}
    return finish_run(trainer.acc, cfg, summary, policy.save, trainer.counters)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(PPOConfig))
