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

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from unialign.config import DTYPES, arg, exit_on_user_error, parse_config
from unialign.embedded import model_path, register
from unialign.errors import UserError
from unialign.recipes import TextDataArgs, columns_of, fit_prompts, load_prompt_data
from unialign.registry import TEXT_ALGORITHMS
from unialign.rewards import get_reward
from unialign.text import CausalLMPolicy, evaluate
from unialign.trainers import OnlineConfig, OnlineTrainer, finish_run
from unialign.trainers.rundir import list_checkpoints


@dataclass
class PPOConfig(TextDataArgs, OnlineConfig):
    ALIASES = {"max_completion_length": "max_new_tokens"}  # TRL's name of the generation length (unialign.trl_compat)
    preset: str | None = arg(None, "named recipe: qwen2.5-0.5b-rm (flags still override it)", group="config")
    config: str | None = arg(None, "YAML file of field values (flags override it)", group="config")
    model_name_or_path: str = arg("embedded", "Hub id, local directory, or 'embedded' (the shipped arithmetic model)",
                                  group="model")
    dataset_name: str = arg("embedded", "'embedded' (the shipped arithmetic task), a Hub id, a local .jsonl/.json/"
                            ".parquet file, or a folder of split files (train.jsonl, test.jsonl, ...)", group="data")
    reward_model_path: str | None = arg(None, "reward-model checkpoint (unset: the embedded one, trained on first use "
                                        "into <output_dir>/reward_model)", group="model")
    reward_model_steps: int | None = arg(None, "optimizer steps of the embedded reward model when it is trained here "
                                         "(unset: train_reward_model.py's default)", group="optimisation", min=1)
    eval_batch_size: int = arg(128, "prompts per greedy-evaluation batch", group="logging", min=1)
    max_new_tokens: int = arg(24, "completion limit in tokens (sampling and evaluation)", group="algorithm", min=1)
    temperature: float = arg(1.0, "sampling temperature (> 0)", group="algorithm", gt=0.0)
    lora_rank: int = arg(0, "> 0: train a LoRA of this rank instead of the full model", group="model", min=0)
    generation_cache: str = arg("auto", "KV cache: auto (static on CUDA), dynamic, or static (fixed size: CUDA graphs)",
                                group="model", choices=("auto", "dynamic", "static"))
    value_head: str = arg("shared", "critic: 'shared' (head on the policy backbone), 'separate' (own backbone copy) or "
                          "a sequence-classification checkpoint such as the reward model", group="model")
    torch_dtype: str = arg("float32", "model dtype", group="model", choices=DTYPES)
    algorithm: str = arg("ppo", "algorithm preset (its knobs can be overridden one by one)", choices=TEXT_ALGORITHMS)
    num_generations: int = arg(1, "completions per prompt")
    prompts_per_step: int = arg(64, "prompts per step")
    micro_batch_size: int = arg(64, "completions per forward/backward")
    learning_rate: float = arg(1e-4, "peak learning rate")
    beta: float | None = arg(0.5, "KL coefficient in the reward; the embedded default needs 0.5 (reward hacking "
                             "below, see README)")
    max_steps: int = arg(40, "training steps (each: sample, score, update)")
    num_threads: int | None = arg(1, "torch CPU threads (tiny models: 1 is fastest; <= 0: torch's choice)")
    output_dir: str = arg("outputs/ppo_rlhf", "where checkpoints, curves, summary.json and final/ go")


PRESETS = {
    "qwen2.5-0.5b-rm": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="openai/gsm8k", dataset_config="main",
        max_new_tokens=256, learning_rate=1e-6, beta=0.05, kl_target=6.0, prompts_per_step=64, micro_batch_size=8,
        max_steps=300, torch_dtype="bfloat16", output_dir="outputs/ppo_qwen"),
}


def reward_model(cfg: PPOConfig) -> Path:
    """The reward model's folder: ``--reward_model_path``, else ``<output_dir>/reward_model/final``, trained there
    first by train_reward_model.py (``--max_steps`` from ``--reward_model_steps``; a killed run's checkpoints are
    resumed) unless it exists. A failed training is a ``UserError`` naming the folder."""
    if cfg.reward_model_path is not None:
        if cfg.reward_model_steps is not None:
            raise UserError("--reward_model_steps: trains the embedded reward model, and --reward_model_path names "
                            "one to use as it is; pass one of them")
        return Path(cfg.reward_model_path)
    out = Path(cfg.output_dir) / "reward_model"
    if (out / "final").exists():
        if cfg.reward_model_steps is not None:
            print(f"reusing the reward model in {out / 'final'} (--reward_model_steps applies to a new one)")
        return out / "final"
    print(f"no reward model in {out}: training the embedded one first", flush=True)
    script = Path(__file__).with_name("train_reward_model.py")
    resume = ["--resume_from_checkpoint", "latest"] if list_checkpoints(out) else []  # a killed one
    steps = [] if cfg.reward_model_steps is None else ["--max_steps", str(cfg.reward_model_steps)]
    code = subprocess.run([sys.executable, str(script), "--output_dir", str(out), "--report_to", "none",
                           *steps, *resume]).returncode
    if code:
        raise UserError(f"training the embedded reward model into {out} failed (exit status {code}; its error is "
                        "above); or pass --reward_model_path")
    return out / "final"


def main(cfg: PPOConfig) -> dict:
    register()  # the demo worlds by name: data set 'embedded', the shape verifiers, GenEval's 'shapes' backend
    start = time.time()
    train, eval_rows, data_info = load_prompt_data(cfg)
    rm_path = reward_model(cfg)
    cfg.reward_model_path = str(rm_path)  # the config recorded (summary.json, trackers) names the model used
    # a bad reward-model path fails before the policy loads; the RM renders prompts as the policy does
    rm = get_reward("reward_model", path=str(rm_path), chat_template=cfg.chat_template)
    policy = CausalLMPolicy.from_pretrained(model_path(cfg.model_name_or_path), lora_rank=cfg.lora_rank,
                                            torch_dtype=cfg.torch_dtype, max_new_tokens=cfg.max_new_tokens,
                                            temperature=cfg.temperature, value_head=cfg.value_head,
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
        main(parse_config(PPOConfig, presets=PRESETS))
