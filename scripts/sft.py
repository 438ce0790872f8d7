"""Supervised fine-tuning (TRL's SFTTrainer): the completion's negative log-likelihood given the prompt, as the
token mean of each optimizer step, on a causal LM or a masked-diffusion LM.

    accelerate launch scripts/sft.py                                          # offline: embedded arithmetic model
    accelerate launch scripts/sft.py --model_name_or_path embedded-mdlm       # its masked-diffusion twin (LLaDA's SFT)
    accelerate launch scripts/sft.py --preset qwen2.5-0.5b-gsm8k                # Qwen2.5-0.5B on GSM8K's answers
    python scripts/sft.py --dataset_name chats.jsonl --model_name_or_path MODEL_DIR --lora_rank 16

Data in TRL's SFT formats (prompt / completion as strings or messages, or ``messages`` conversations ending with
the assistant's turn) or GSM8K's question / answer: a Hub id, a .jsonl/.json/.parquet file or a folder of split
files. Only the completion's tokens are trained. Writes <output_dir>/summary.json (the embedded task's greedy
accuracy before / after, else the held-out token NLL), loss_curve.png, checkpoints and final/.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from unialign.config import arg, default, exit_on_user_error, parse_config
from unialign.embedded import MDLM_NAME, NAME, check_model_kind, model_path, register
from unialign.embedded.args import EmbeddedTaskArgs, tuned_for
from unialign.recipes import presets
from unialign.recipes.args import DiffusionLMArgs, RunArgs, TextModelArgs
from unialign.recipes.text import (
    TextDataArgs,
    check_masked_diffusion_source,
    load_sft_data,
    masked_diffusion_policy,
    train_sft_run,
)
from unialign.recipes.vision import greedy_task_score, load_policy
from unialign.trainers.preference import PreferenceConfig, SFTObjective

PRESETS = presets.SFT
TASKS = {NAME: "math_accuracy"}  # built-in data sets with a verifiable task: greedy accuracy before / after


@dataclass
class SFTScriptConfig(EmbeddedTaskArgs, RunArgs, DiffusionLMArgs, TextModelArgs, TextDataArgs, PreferenceConfig):
    PRESETS: ClassVar[dict] = PRESETS
    TRL_CONFIG: ClassVar[str] = "SFTConfig"  # the defaults below are TRL's unless printed at start
    MODEL_DEFAULTS: ClassVar[dict] = tuned_for((NAME, MDLM_NAME), dict(  # measured on the shipped models
        learning_rate=3e-4, lr_scheduler_type="constant", batch_size=32, micro_batch_size=32, num_threads=1))
    chat_template: str = arg("auto", "auto (a string prompt raw, a conversation templated), always, never",
                             group="model", choices=("auto", "always", "never"))
    max_new_tokens: int = arg(32, "completion limit of the greedy task evaluation (embedded task)", group="logging",
                              min=1)
    learning_rate: float = default(2e-5)  # TRL's
    lr_scheduler_type: str = default("linear")
    max_steps: int = default(40)
    output_dir: str = default("outputs/sft")


def main(cfg: SFTScriptConfig) -> dict:
    register()  # the demo worlds by name: data set and model 'embedded', 'embedded-mdlm'
    check_model_kind(cfg.model_name_or_path, ("text",))  # a model of another kind: one line, now
    start = time.time()
    check_masked_diffusion_source(cfg)  # a Hub masked-diffusion LM: remote code allowed, reachable
    train, held_out, data_info = load_sft_data(cfg)  # rows checked before the model loads
    policy = masked_diffusion_policy(cfg, model_path(cfg.model_name_or_path), "elbo_mc")  # the ELBO: LLaDA's SFT
    policy = policy or load_policy(model_path(cfg.model_name_or_path), **cfg.model_kwargs(),
                                   max_new_tokens=cfg.max_new_tokens, chat_template=cfg.chat_template)
    task = TASKS.get(cfg.dataset_name)
    task_score = (lambda: greedy_task_score(policy, cfg, task)) if task else None  # noqa: E731
    return train_sft_run(cfg, SFTObjective(policy, train), train, held_out, data_info, start, task_score)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(SFTScriptConfig))
