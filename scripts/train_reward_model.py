"""Bradley-Terry reward model: a scalar head on a causal-LM backbone trained on preference pairs.

    accelerate launch scripts/train_reward_model.py          # offline: embedded model, correct vs wrong answers
    accelerate launch scripts/train_reward_model.py --preset qwen2.5-0.5b-ultrafeedback
    python scripts/train_reward_model.py --dataset_name pairs.jsonl --eval_dataset_name held_out.jsonl

Data in TRL's preference formats (prompt / chosen / rejected, optional margin). Writes
<output_dir>/summary.json (held-out pairwise accuracy before/after) and <output_dir>/final, a stock
``*ForSequenceClassification`` checkpoint usable as ``get_reward("reward_model", path=...)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from accelerate.utils import set_seed

from unialign.config import DTYPES, arg, default, exit_on_user_error, parse_config
from unialign.embedded import NAME, check_model_kind, model_path, register
from unialign.embedded.args import EmbeddedPairArgs, tuned_for
from unialign.recipes import presets
from unialign.recipes.args import RunArgs
from unialign.recipes.outputs import finish_run
from unialign.recipes.text import TextDataArgs, fit_pairs, load_pair_data
from unialign.text.data import bounded_counts, max_token_bytes
from unialign.text.reward_model import RewardModel
from unialign.trainers.preference import BradleyTerryObjective, PreferenceConfig, PreferenceTrainer

PRESETS = presets.REWARD_MODEL


@dataclass
class RewardModelConfig(EmbeddedPairArgs, RunArgs, TextDataArgs, PreferenceConfig):
    PRESETS: ClassVar[dict] = PRESETS
    TRL_CONFIG: ClassVar[str] = "RewardConfig"  # the defaults below are TRL's unless printed at start
    MODEL_DEFAULTS: ClassVar[dict] = tuned_for((NAME,), dict(  # measured on the shipped model (docs/text.md)
        batch_size=64, micro_batch_size=64, learning_rate=1e-3, lr_scheduler_type="cosine", max_steps=600, num_threads=1))
    center_coef: float = arg(0.01, "weight of the reward-centring term (mean reward pulled to 0)",
                             group="algorithm", min=0.0)
    max_length: int | None = arg(None, "truncate prompt + completion to this many tokens when scoring",
                                 group="data", min=1)
    torch_dtype: str = arg("float32", "model dtype", group="model", choices=DTYPES)
    gradient_checkpointing: bool = arg(False, "recompute each layer's activations in the backward pass (less memory)",
                                       group="model")
    learning_rate: float = default(1e-4)  # TRL's
    lr_scheduler_type: str = default("linear")
    max_steps: int = default(150)
    output_dir: str = default("outputs/reward_model")




def main(cfg: RewardModelConfig) -> dict:
    register()  # the demo worlds by name: data set 'embedded', the shape verifiers, GenEval's 'shapes' backend
    check_model_kind(cfg.model_name_or_path, ("text",))  # a model of another kind: one line, now
    start = time.time()
    set_seed(cfg.seed)  # the new score head is initialised below
    train, held_out, data_info = load_pair_data(cfg)
    rm = RewardModel.from_pretrained(model_path(cfg.model_name_or_path), torch_dtype=cfg.torch_dtype,
                                   gradient_checkpointing=cfg.gradient_checkpointing, max_length=cfg.max_length,
                                   chat_template=cfg.chat_template)
    tok = rm.tokenizer

    def prompt_tokens(prompts: list, limit: int) -> list[int]:  # the reward model's own prompt text (template, EOS)
        return bounded_counts([rm._text(p, "") for p in prompts], limit, lambda texts: [
            len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]], max_token_bytes(tok))

    train, held_out = fit_pairs(tok, prompt_tokens, train, held_out, cfg, data_info)
    trainer = PreferenceTrainer(BradleyTerryObjective(rm, cfg.center_coef), train, cfg, eval_rows=held_out)
    before = trainer.evaluate(held_out)["accuracy"]
    trainer.train()
    after = trainer.evaluate(held_out)["accuracy"]
    summary = {"metric": "pairwise_accuracy", "before": before, "after": after, "steps": trainer.step,
               "wall_seconds": time.time() - start, "num_eval_pairs": len(held_out), **data_info}
    return finish_run(trainer.acc, cfg, summary, rm.save)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(RewardModelConfig))
