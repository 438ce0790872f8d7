"""GRPO (and DAPO / Dr.GRPO / GSPO / RLOO / PPO's shared critic via --algorithm) on a vision-language model.

    accelerate launch scripts/grpo_vision.py                 # offline: the embedded tiny VLM on shapes-world questions
    accelerate launch scripts/grpo_vision.py --preset qwen2.5-vl-3b-geometry3k     # EasyR1's recipe
    python scripts/grpo_vision.py --dataset_name my_data/ --reward_funcs my_rewards.py:score

Data in TRL's vision format: ``prompt`` (a string or messages; ``{"type": "image"}`` blocks or ``<image>``
placeholders where the images go, else before the first user message) with an ``image`` or ``images`` column
(PIL images, bytes, ``{"bytes", "path"}`` or paths relative to the data file); text-only rows mix in. Every
other column reaches the rewards. Writes <output_dir>/summary.json (held-out greedy accuracy before/after),
completions.jsonl, reward_curve.png and checkpoints; final/ loads with AutoModelForImageTextToText.
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
    check_rewards,
    columns_of,
    fit_prompts,
    load_prompt_data,
)
from unialign.registry import TEXT_ALGORITHMS
from unialign.text import evaluate
from unialign.trainers import OnlineConfig, OnlineTrainer, finish_run
from unialign.vision import VisionLanguagePolicy
from unialign.vision.recipe import VisionArgs, processor_kwargs, with_images

GEOMETRY_PROMPT = ("{content} You FIRST think about the reasoning process as an internal monologue and then provide "
                   "the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
                   "answer MUST BE put in \\boxed{}.")


@dataclass
class GRPOVisionConfig(VisionArgs, TextDataArgs, OnlineConfig):
    ALIASES = {"max_completion_length": "max_new_tokens"}  # TRL's name of the generation length
    preset: str | None = arg(None, "named recipe: qwen2.5-vl-3b-geometry3k (flags still override it)", group="config")
    config: str | None = arg(None, "YAML file of field values (flags override it)", group="config")
    model_name_or_path: str = arg("embedded-vlm", "Hub id, local directory, or 'embedded-vlm' (the shipped tiny "
                                  "Qwen2-VL-architecture model)", group="model")
    dataset_name: str = arg("embedded-vlm", "'embedded-vlm' (questions about shapes-world images), a Hub id, a local "
                            ".jsonl/.json/.parquet file, or a folder of split files", group="data")
    eval_batch_size: int = arg(64, "prompts per greedy-evaluation batch", group="logging", min=1)
    max_new_tokens: int = arg(8, "completion limit in tokens (sampling and evaluation)", group="algorithm", min=1)
    temperature: float = arg(1.0, "sampling temperature (> 0)", group="algorithm", gt=0.0)
    top_p: float = arg(1.0, "nucleus sampling mass", group="algorithm", gt=0.0, max=1.0)
    top_k: int = arg(0, "sample among the k most likely tokens (0: all)", group="algorithm", min=0)
    system_prompt: str | None = arg(None, "system message put before every prompt", group="model")
    lora_rank: int = arg(0, "> 0: train a LoRA of this rank on the language model's projections", group="model", min=0)
    torch_dtype: str = arg("float32", "model dtype", group="model", choices=DTYPES)
    reward_funcs: str = arg("vlm_accuracy", "comma-separated rewards: registry names, package.module.function, "
                            "module:function or path/file.py:function", group="algorithm")
    reward_weights: str | None = arg(None, "comma-separated floats, one per reward (default: all 1)", group="algorithm")
    eval_reward: str | None = arg(None, "reward of the held-out greedy evaluation (default: the training reward)",
                                  group="algorithm")
    algorithm: str = arg("grpo", "algorithm preset (its knobs can be overridden one by one)", choices=TEXT_ALGORITHMS)
    beta: float | None = arg(0.0, "KL coefficient to the reference model (0: no reference; None: the preset's)")
    learning_rate: float = arg(1e-3, "peak learning rate")
    warmup_steps: int = arg(5, "linear warm-up steps")
    lr_scheduler_type: str = arg("cosine", "learning-rate schedule after warm-up", choices=["constant", "linear", "cosine"])
    prompts_per_step: int = arg(16, "prompts per step (each sampled num_generations times)")
    num_generations: int = arg(8, "completions per prompt (the group)")
    micro_batch_size: int = arg(128, "completions per forward/backward")
    max_steps: int = arg(60, "training steps (each: sample, score, update)")
    num_threads: int | None = arg(1, "torch CPU threads (tiny models: 1 is fastest; <= 0: torch's choice)")
    output_dir: str = arg("outputs/grpo_vision", "where checkpoints, curves, summary.json and final/ go")


PRESETS = {
    # EasyR1's examples/qwen2_5_vl_3b_geo3k_grpo.sh (hiyouga/EasyR1): Qwen2.5-VL-3B-Instruct on geometry3k
    "qwen2.5-vl-3b-geometry3k": dict(
        model_name_or_path="Qwen/Qwen2.5-VL-3B-Instruct", dataset_name="hiyouga/geometry3k", prompt_column="problem",
        prompt_template=GEOMETRY_PROMPT,
        eval_split="test", reward_funcs="math_accuracy", max_new_tokens=2048, max_prompt_length=2048,
        max_pixels=1003520, min_pixels=262144, learning_rate=1e-6, beta=0.01, num_generations=5,
        prompts_per_step=128, micro_batch_size=16, max_steps=100, torch_dtype="bfloat16", warmup_steps=0,
        lr_scheduler_type="constant", num_eval=601, eval_batch_size=16, freeze_vision=True,
        output_dir="outputs/grpo_qwen2.5_vl_geo3k"),
}


def main(cfg: GRPOVisionConfig) -> dict:
    register()  # the demo worlds by name: 'embedded-vlm' (data set, model, vlm_accuracy reward)
    start = time.time()
    train_rows, eval_rows, data_info = load_prompt_data(cfg)
    train_rows = with_images(train_rows, cfg, f"{cfg.dataset_name} [train]", data_info)  # checked before the model
    eval_rows = with_images(eval_rows, cfg, data_info.get("eval_source", "eval"), data_info)
    check_rewards(cfg.reward_funcs, cfg.reward_weights, columns_of(train_rows), modality="text")
    check_rewards(cfg.eval_reward or cfg.reward_funcs, None if cfg.eval_reward else cfg.reward_weights,
                  columns_of(eval_rows), "--eval_reward" if cfg.eval_reward else "--reward_funcs", modality="text")
    policy = VisionLanguagePolicy.from_pretrained(
        model_path(cfg.model_name_or_path), lora_rank=cfg.lora_rank, torch_dtype=cfg.torch_dtype,
        processor_kwargs=processor_kwargs(cfg), freeze_vision=cfg.freeze_vision, max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, system_prompt=cfg.system_prompt,
        chat_template=cfg.chat_template, value_head=cfg.algo_spec().value_coef > 0)  # PPO: the shared critic head
    train_rows, eval_rows = fit_prompts(policy, train_rows, eval_rows, cfg, data_info)  # image tokens counted
    reward = build_reward(cfg.reward_funcs, cfg.reward_weights, timeout_s=cfg.reward_timeout)
    scorer = as_trl_reward(build_reward(cfg.eval_reward, None, "--eval_reward", cfg.reward_timeout)
                           if cfg.eval_reward else reward)
    cfg.max_completion_length = cfg.max_new_tokens  # the loss normaliser's L, as in TRL

    metric = "accuracy"
    held_out = evaluate.GreedyHeldOut(policy, eval_rows, {metric: scorer}, cfg.eval_batch_size)
    trainer = OnlineTrainer(policy, reward, train_rows, cfg, evaluator=held_out)
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
        main(parse_config(GRPOVisionConfig, presets=PRESETS))
