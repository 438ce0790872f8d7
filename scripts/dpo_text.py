"""DPO (sigmoid / IPO / hinge / robust-cDPO, RPO), SimPO or ORPO on text preference pairs.

    accelerate launch scripts/dpo_text.py                     # offline: embedded arithmetic model, correct vs wrong answers
    accelerate launch scripts/dpo_text.py --algorithm simpo   # reference-free: no reference model is built
    accelerate launch scripts/dpo_text.py --preset qwen2.5-0.5b-ultrafeedback
    python scripts/dpo_text.py --dataset_name pairs.jsonl --model_name_or_path MODEL_DIR

Data in TRL's preference formats (prompt / chosen / rejected as strings or messages, or implicit-prompt
conversations): a Hub id, a .jsonl/.json/.parquet file or a folder of split files. Writes
<output_dir>/summary.json: task accuracy of fresh greedy samples before/after (embedded task), held-out
implicit accuracy before/after and the first logged loss; loss_curve.png; checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from unialign.algos.pair_losses import check_pair_loss_params
from unialign.algos.preference import DPO_LOSS_TYPES, REFERENCE_FREE_LOSSES
from unialign.config import DTYPES, UserError, arg, exit_on_user_error, parse_config
from unialign.embedded import NAME, model_path, register
from unialign.recipes import TextDataArgs, fit_pairs, load_pair_data
from unialign.rewards import get_reward
from unialign.text import evaluate, load_rows
from unialign.text.data import prompt_rows, prompt_token_counter
from unialign.trainers import finish_run
from unialign.trainers.preference import DPOObjective, PreferenceConfig, PreferenceTrainer, fingerprint
from unialign.vision.recipe import VisionTowerArgs, has_images, load_policy, with_images

TASKS = {NAME: "math_accuracy", "embedded-vlm": "vlm_accuracy"}  # built-in data sets with a verifiable task

# per-algorithm defaults of --beta / --simpo_gamma / --rpo_alpha (flags override them)
ALGORITHM_DEFAULTS = {
    "dpo": dict(beta=0.1, rpo_alpha=1.0),  # RPO on the embedded task (the preset sets plain DPO)
    # SimPO's beta / gamma (and TRL's) plus the chosen NLL (TRL's CPO-SimPO): plain SimPO (rpo_alpha 0) drove
    # the embedded task's greedy accuracy to 0.10 / 0.00 (seeds 0 / 1), nothing holds the chosen answer up
    "simpo": dict(beta=2.0, simpo_gamma=0.5, rpo_alpha=2.0),
    "orpo": dict(beta=0.1, rpo_alpha=1.0),  # ORPO: lambda 0.1 and the chosen NLL, as the paper and TRL
}


def _defaults(key: str) -> str:
    return "default: " + ", ".join(f"{a} {d[key]}" for a, d in ALGORITHM_DEFAULTS.items() if key in d)


@dataclass
class DPOTextConfig(TextDataArgs, VisionTowerArgs, PreferenceConfig):
    preset: str | None = arg(None, "named recipe: qwen2.5-0.5b-ultrafeedback (flags still override it)", group="config")
    config: str | None = arg(None, "YAML file of field values (flags override it)", group="config")
    model_name_or_path: str = arg("embedded", "Hub id, local directory, or 'embedded' (the shipped arithmetic model)",
                                  group="model")
    dataset_name: str = arg("embedded", "'embedded' (the shipped arithmetic task), a Hub id, a local .jsonl/.json/"
                            ".parquet file, or a folder of split files (train.jsonl, test.jsonl, ...)", group="data")
    max_completion_length: int | None = arg(1024, "longest chosen / rejected completion in tokens (EOS included); "
                                            "longer pairs are refused", group="data", min=1)
    algorithm: str = arg("dpo", "pair loss: dpo (the --loss_type variant, against a reference model), or the "
                         "reference-free simpo / orpo (no reference model)",
                         group="algorithm", choices=("dpo", *REFERENCE_FREE_LOSSES))
    beta: float | None = arg(None, "temperature (DPO: strength of the implicit KL to the reference; ORPO: weight of "
                             f"the odds-ratio term); {_defaults('beta')}", group="algorithm", min=0.0)
    loss_type: str = arg("sigmoid", "DPO loss (--algorithm dpo)", group="algorithm", choices=DPO_LOSS_TYPES)
    label_smoothing: float = arg(0.0, "assumed label-noise rate (cDPO for sigmoid; robust DPO)",
                                 group="algorithm", min=0.0, lt=0.5)
    simpo_gamma: float | None = arg(None, f"SimPO target reward margin gamma; {_defaults('simpo_gamma')}",
                                    group="algorithm", min=0.0)
    rpo_alpha: float | None = arg(None, "weight of the chosen side's per-token NLL (RPO; ORPO's SFT term; plain DPO / "
                                  f"SimPO lower the embedded task's accuracy, see README); {_defaults('rpo_alpha')}",
                                  group="algorithm", min=0.0)
    lora_rank: int = arg(0, "> 0: train a LoRA of this rank instead of the full model", group="model", min=0)
    torch_dtype: str = arg("float32", "model dtype", group="model", choices=DTYPES)
    precompute_ref_log_probs: bool = arg(False, "score every pair with the reference once, up front (cached on disk)",
                                         group="algorithm")
    max_new_tokens: int = arg(24, "completion limit of the greedy task evaluation (embedded task)",
                              group="logging", min=1)
    batch_size: int = arg(32, "pairs per optimizer step")
    micro_batch_size: int = arg(32, "pairs per forward/backward")
    learning_rate: float = arg(2e-4, "peak learning rate")
    max_steps: int = arg(60, "optimizer steps")
    num_threads: int | None = arg(1, "torch CPU threads (tiny models: 1 is fastest)")
    output_dir: str = arg("outputs/dpo_text", "where checkpoints, curves, summary.json and final/ go")


PRESETS = {
    "qwen2.5-0.5b-ultrafeedback": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="trl-lib/ultrafeedback_binarized",
        rpo_alpha=0.0, learning_rate=5e-7, batch_size=64, micro_batch_size=4, max_steps=1000, torch_dtype="bfloat16",
        warmup_steps=50, num_eval=512, output_dir="outputs/dpo_qwen_ultrafeedback"),
}


def pair_loss(cfg: DPOTextConfig) -> tuple[str, dict, dict]:
    """(registered pair loss, its knobs with the algorithm's defaults filled in, the loss's own parameters),
    checked before any model loads."""
    knobs = {k: v if getattr(cfg, k) is None else getattr(cfg, k) for k, v in ALGORITHM_DEFAULTS[cfg.algorithm].items()}
    if cfg.simpo_gamma is not None and "simpo_gamma" not in knobs:
        raise UserError(f"--simpo_gamma: applies to --algorithm simpo, not {cfg.algorithm}")
    if cfg.algorithm != "dpo" and cfg.loss_type != "sigmoid":
        raise UserError(f"--loss_type: chooses the DPO variant of --algorithm dpo, not of {cfg.algorithm}")
    loss = cfg.loss_type if cfg.algorithm == "dpo" else cfg.algorithm  # an entry of algos.PAIR_LOSSES
    params = {"gamma": knobs["simpo_gamma"]} if "simpo_gamma" in knobs else {}
    check_pair_loss_params(loss, cfg.label_smoothing, **params)
    return loss, knobs, params


def main(cfg: DPOTextConfig) -> dict:
    register()  # the demo worlds by name: data set 'embedded', the shape verifiers, GenEval's 'shapes' backend
    start = time.time()
    loss, knobs, params = pair_loss(cfg)
    task = TASKS.get(cfg.dataset_name)  # correct vs wrong final answers on an embedded task (arithmetic; VLM)
    embedded = task is not None
    train, held_out, data_info = load_pair_data(cfg)
    if has_images(train + held_out):  # image + prompt + chosen / rejected (RLAIF-V): images read and checked now
        train, held_out = with_images(train, cfg, "train", data_info), with_images(held_out, cfg, "eval", data_info)
    policy = load_policy(model_path(cfg.model_name_or_path), cfg.freeze_vision, lora_rank=cfg.lora_rank,
                         torch_dtype=cfg.torch_dtype, max_new_tokens=cfg.max_new_tokens, chat_template=cfg.chat_template)
    train, held_out = fit_pairs(policy.tokenizer, prompt_token_counter(policy), train, held_out, cfg, data_info)
    objective = DPOObjective(policy, knobs["beta"], loss, cfg.label_smoothing, cache_reference=cfg.precompute_ref_log_probs,
                             rpo_alpha=knobs["rpo_alpha"], loss_params=params)
    if cfg.precompute_ref_log_probs:
        key = fingerprint(train, policy.model)
        objective.precompute(train, cfg.eval_batch_size, Path(cfg.output_dir) / f"ref_cache-{key}.safetensors")
    trainer = PreferenceTrainer(objective, train, cfg, eval_rows=held_out)  # --eval_steps: held-out curve

    def task_accuracy() -> float | None:
        if not embedded:
            return None
        rows = prompt_rows(load_rows(cfg.dataset_name, "test")[:cfg.num_eval], "eval")
        rows = with_images(rows, cfg, "eval") if has_images(rows) else rows
        return evaluate.greedy_score(policy, rows, get_reward(task), cfg.eval_batch_size)

    acc_before, implicit_before = task_accuracy(), trainer.evaluate(held_out)["implicit_accuracy"]
    history = [h for h in trainer.train() if "loss" in h]  # training steps (held-out evaluations are eval/* rows)
    acc_after, implicit_after = task_accuracy(), trainer.evaluate(held_out)["implicit_accuracy"]
    summary = {"metric": "accuracy" if embedded else "implicit_accuracy", "pair_loss": loss, **knobs,
               "before": acc_before if embedded else implicit_before,
               "after": acc_after if embedded else implicit_after,
               "implicit_accuracy_before": implicit_before, "implicit_accuracy_after": implicit_after,
               "first_loss": history[0]["loss"] if history else None,
               "first_nll_loss": history[0].get("nll_loss") if history else None, "steps": trainer.step,
               "wall_seconds": time.time() - start, "num_eval_pairs": len(held_out), **data_info}
    return finish_run(trainer.acc, cfg, summary, policy.save)


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(DPOTextConfig, presets=PRESETS))
