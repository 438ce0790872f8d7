"""GRPO (and DAPO / Dr.GRPO / GSPO / RLOO via --algorithm) on prompts scored by reward functions.

    accelerate launch scripts/grpo_math.py                       # offline embedded default, CPU, minutes
    accelerate launch scripts/grpo_math.py --preset qwen2.5-0.5b-gsm8k   # Qwen2.5-0.5B-Instruct on GSM8K
    python scripts/grpo_math.py --algorithm dapo --max_steps 20 --output_dir outputs/dapo
    python scripts/grpo_math.py --dataset_name my_data/ --reward_funcs my_rewards.brevity,math_accuracy

Data: TRL's prompt formats (``prompt`` as a string or a list of messages; every other column is passed
to the reward functions) or GSM8K's ``question`` / ``answer``; a Hub id, a .jsonl/.json/.parquet file
or a folder of split files. Writes <output_dir>/summary.json (held-out greedy score before/after),
reward_curve.png, TensorBoard logs and checkpoints (resume with --resume_from_checkpoint latest).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from unialign.config import DTYPES, arg, exit_on_user_error, parse_config
from unialign.embedded import model_path, register
from unialign.recipes import (
    TextDataArgs,
    as_trl_reward,
    build_reward,
    check_generation_backend,
    check_rewards,
    columns_of,
    fit_prompts,
    load_prompt_data,
)
from unialign.registry import TEXT_ALGORITHMS
from unialign.text import CausalLMPolicy, evaluate
from unialign.trainers import OnlineConfig, OnlineTrainer, finish_run

SYSTEM_GSM8K = ("Solve the problem step by step. End your answer with a final line of the form "
                "'#### <number>'.")


@dataclass
class GRPOMathConfig(TextDataArgs, OnlineConfig):
    ALIASES = {"max_completion_length": "max_new_tokens"}  # TRL's name of the generation length (unialign.trl_compat)
    preset: str | None = arg(None, "named recipe: qwen2.5-0.5b-gsm8k (flags still override it)", group="config")
    config: str | None = arg(None, "YAML file of field values (flags override it)", group="config")
    model_name_or_path: str = arg("embedded", "Hub id, local directory, or 'embedded' (the shipped arithmetic model)",
                                  group="model")
    dataset_name: str = arg("embedded", "'embedded' (the shipped arithmetic task), a Hub id, a local .jsonl/.json/"
                            ".parquet file, or a folder of split files (train.jsonl, test.jsonl, ...)", group="data")
    eval_batch_size: int = arg(128, "prompts per greedy-evaluation batch", group="logging", min=1)
    # correct answers of the embedded task are 20-25 tokens with EOS; 32 leaves DAPO's overlong buffer
    # (the last 20 %, 6 tokens) beyond them: at 26 it docked correct carry answers and DAPO fell 0.53 -> 0.50
    max_new_tokens: int = arg(32, "completion limit in tokens (sampling and evaluation)", group="algorithm", min=1)
    temperature: float = arg(1.0, "sampling temperature (> 0)", group="algorithm", gt=0.0)
    top_p: float = arg(1.0, "nucleus sampling: keep the smallest token set with this probability mass",
                       group="algorithm", gt=0.0, max=1.0)
    top_k: int = arg(0, "sample among the k most likely tokens (0: all)", group="algorithm", min=0)
    system_prompt: str | None = arg(None, "system message put before every prompt (chat-template models)",
                                    group="model")
    lora_rank: int = arg(0, "> 0: train a LoRA of this rank instead of the full model", group="model", min=0)
    torch_dtype: str = arg("float32", "model dtype", group="model", choices=DTYPES)
    generation_cache: str = arg("auto", "KV cache: auto (static on CUDA), dynamic, or static (fixed size: CUDA graphs)",
                                group="model", choices=("auto", "dynamic", "static"))
    generation_backend: str = arg("hf", "rollout engine: hf (transformers generate) or vllm (colocated; CUDA + pip "
                                  "install 'unialign[vllm]')", group="model", choices=("hf", "vllm"))
    vllm_gpu_memory_utilization: float = arg(0.3, "vllm: share of the GPU memory the engine takes",
                                             group="model", gt=0.0, max=1.0)
    rollout_dtype: str | None = arg(None, "sample from a copy of the policy in this dtype (a rollout/trainer mismatch, "
                                    "corrected by --rollout_correction); unset: sample from the trained model",
                                    group="model", choices=DTYPES)
    reward_funcs: str = arg("math_accuracy", "comma-separated rewards: registry names, TRL's dotted "
                            "package.module.function, module:function or path/file.py:function", group="algorithm")
    reward_weights: str | None = arg(None, "comma-separated floats, one per reward (default: all 1)", group="algorithm")
    eval_reward: str | None = arg(None, "reward of the held-out greedy evaluation (default: math_accuracy when the "
                                  "rows have an 'answer' or 'solution' column, else the training reward)",
                                  group="algorithm")
    # embedded-default training knobs (overriding OnlineConfig's generic defaults)
    algorithm: str = arg("grpo", "algorithm preset (its knobs can be overridden one by one)", choices=TEXT_ALGORITHMS)
    beta: float | None = arg(0.0, "KL coefficient to the reference model (0: no reference; None: the preset's)")
    learning_rate: float = arg(3e-4, "peak learning rate")
    warmup_steps: int = arg(5, "linear warm-up steps")
    # cosine over 100 steps: 0.508 -> 0.730 / 0.723 / 0.734 (seeds 0-2); on the previous build of the model (0.531):
    # cosine 0.848 / 0.805 / 0.859, constant lr 0.707 / 0.680 / 0.688
    # at 80 steps, and at 100 steps seed 2 collapsed to 0.402
    lr_scheduler_type: str = arg("cosine", "learning-rate schedule after warm-up", choices=["constant", "linear", "cosine"])
    prompts_per_step: int = arg(16, "prompts per step (each sampled num_generations times)")
    num_generations: int = arg(8, "completions per prompt (the group)")
    micro_batch_size: int = arg(128, "completions per forward/backward")
    max_steps: int = arg(100, "training steps (each: sample, score, update)")
    num_threads: int | None = arg(1, "torch CPU threads (tiny models: 1 is fastest; <= 0: torch's choice)")
    output_dir: str = arg("outputs/grpo_math", "where checkpoints, curves, summary.json and final/ go")


PRESETS = {
    # verl / TRL-style recipe for Qwen2.5-0.5B-Instruct on GSM8K (one GPU)
    "qwen2.5-0.5b-gsm8k": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="openai/gsm8k", dataset_config="main",
        system_prompt=SYSTEM_GSM8K, chat_template="always", max_new_tokens=512, temperature=1.0, learning_rate=1e-6, beta=0.0,
        prompts_per_step=32, num_generations=8, micro_batch_size=16, max_steps=500, num_eval=1319,
        torch_dtype="bfloat16", warmup_steps=10, lr_scheduler_type="constant", eval_batch_size=64,
        output_dir="outputs/grpo_qwen_gsm8k"),
}


def main(cfg: GRPOMathConfig) -> dict:
    register()  # the demo worlds by name: data set 'embedded', the shape verifiers, GenEval's 'shapes' backend
    start = time.time()
    check_generation_backend(cfg.generation_backend)
    train_rows, eval_rows, data_info = load_prompt_data(cfg)
    eval_name = cfg.eval_reward or ("math_accuracy" if {"answer", "solution"} & columns_of(eval_rows) else None)
    check_rewards(cfg.reward_funcs, cfg.reward_weights, columns_of(train_rows), modality="text")
    check_rewards(eval_name or cfg.reward_funcs, None if eval_name else cfg.reward_weights, columns_of(eval_rows),
                  "--eval_reward" if eval_name else "--reward_funcs", modality="text")  # the held-out rows' too
    policy = CausalLMPolicy.from_pretrained(
        model_path(cfg.model_name_or_path), lora_rank=cfg.lora_rank, torch_dtype=cfg.torch_dtype,
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        system_prompt=cfg.system_prompt, chat_template=cfg.chat_template, generation_cache=cfg.generation_cache,
        rollout_dtype=cfg.rollout_dtype, generation_backend=cfg.generation_backend,
        vllm_options={"gpu_memory_utilization": cfg.vllm_gpu_memory_utilization, "seed": cfg.seed})
    train_rows, eval_rows = fit_prompts(policy, train_rows, eval_rows, cfg, data_info)  # before any forward
    reward = build_reward(cfg.reward_funcs, cfg.reward_weights, timeout_s=cfg.reward_timeout)
    scorer = as_trl_reward(build_reward(eval_name, None, "--eval_reward", cfg.reward_timeout) if eval_name else reward)
    cfg.max_completion_length = cfg.max_new_tokens  # the loss normaliser's L and DAPO's limit: TRL's too

    metric = "accuracy" if eval_name == "math_accuracy" else eval_name or "reward"
    held_out = evaluate.GreedyHeldOut(policy, eval_rows, {metric: scorer}, cfg.eval_batch_size)
    trainer = OnlineTrainer(policy, reward, train_rows, cfg, evaluator=held_out)  # eval/<metric> every eval_steps
    before = trainer.evaluate()[f"eval/{metric}"]
    trainer.acc.print(f"held-out greedy {metric} before: {before:.3f}")
    history = trainer.train()
    after = trainer.evaluate()[f"eval/{metric}"]
    trainer.acc.print(f"held-out greedy {metric} after:  {after:.3f}")
    summary = {"metric": metric, "before": before, "after": after, "steps": trainer.step,
               "wall_seconds": time.time() - start, "num_eval": len(eval_rows), **data_info,
               "final_train_reward": next((h["reward/mean"] for h in reversed(history) if "reward/mean" in h), None)}
    return finish_run(trainer.acc, cfg, summary, policy.save, trainer.counters)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(GRPOMathConfig, presets=PRESETS))
