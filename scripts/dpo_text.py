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
from typing import ClassVar

from unialign.algos.preference import DPO_LOSS_TYPES
from unialign.config import UserError, arg, default, exit_on_user_error, origin, parse_config
from unialign.embedded import MDLM_NAME, NAME, VLM_NAME, check_model_kind, model_path, register
from unialign.embedded.args import EmbeddedPairArgs, tuned_for
from unialign.recipes import presets
from unialign.recipes.args import DiffusionLMArgs, RunArgs, TextModelArgs
from unialign.recipes.text import (
    TextDataArgs,
    check_masked_diffusion_source,
    defaults_help,
    fit_pairs,
    load_pair_data,
    masked_diffusion_policy,
    pair_algorithms,
    pair_defaults,
    pair_loss,
    train_pair_run,
)
from unialign.recipes.vision import VisionTowerArgs, greedy_task_score, has_images, load_policy, with_images
from unialign.text.data import prompt_token_counter
from unialign.trainers.preference import DPOObjective, PreferenceConfig

PRESETS = presets.DPO_TEXT
TASKS = {NAME: "math_accuracy", "embedded-vlm": "vlm_accuracy"}  # built-in data sets with a verifiable task
SHIPPED = (NAME, MDLM_NAME, VLM_NAME)  # the shipped models, whose measured defaults follow
# the chosen side's NLL weight on the embedded task (RPO; SimPO's with TRL's CPO-SimPO; docs/text.md): plain DPO /
# SimPO lower its greedy accuracy (VRPO too on the masked-diffusion LM: 0.551 -> 0.47-0.54 without it, docs/dlm.md);
# beta and SimPO's gamma are the losses' own defaults (unialign.algos.pair_losses). Any other model: the losses'
# own values throughout (no NLL term for DPO, as TRL).
MEASURED = pair_defaults({"dpo": 1.0, "vrpo": 1.0, "simpo": 2.0})
ALGORITHM_DEFAULTS = pair_defaults({})


@dataclass
class DPOTextConfig(EmbeddedPairArgs, RunArgs, DiffusionLMArgs, TextModelArgs, TextDataArgs, VisionTowerArgs,
                    PreferenceConfig):
    PRESETS: ClassVar[dict] = PRESETS
    TRL_CONFIG: ClassVar[str] = "DPOConfig"  # the defaults below are TRL's unless printed at start (trl_departures)
    MODEL_DEFAULTS: ClassVar[dict] = tuned_for(SHIPPED, dict(  # measured on the shipped models (docs/text.md)
        learning_rate=2e-4, lr_scheduler_type="constant", batch_size=32, micro_batch_size=32, num_threads=1))
    algorithm: str = arg("dpo", "pair loss: dpo (the --loss_type variant, against a reference model), vrpo (dpo on a "
                         "masked-diffusion LM, masks shared with the reference), or the reference-free simpo / orpo",
                         group="algorithm", choices=pair_algorithms)
    beta: float | None = arg(None, "temperature (DPO: strength of the implicit KL to the reference; ORPO: weight of "
                             f"the odds-ratio term); {defaults_help(ALGORITHM_DEFAULTS, 'beta')}", group="algorithm",
                             min=0.0)
    loss_type: str = arg("sigmoid", "DPO loss (--algorithm dpo)", group="algorithm", choices=DPO_LOSS_TYPES)
    label_smoothing: float = arg(0.0, "assumed label-noise rate (cDPO for sigmoid; robust DPO)",
                                 group="algorithm", min=0.0, lt=0.5)
    simpo_gamma: float | None = arg(None, "SimPO target reward margin gamma; "
                                    f"{defaults_help(ALGORITHM_DEFAULTS, 'simpo_gamma')}", group="algorithm", min=0.0)
    rpo_alpha: float | None = arg(None, "weight of the chosen side's per-token NLL (RPO; ORPO's SFT term; plain DPO / "
                                  "SimPO lower the embedded task's accuracy, see README); "
                                  f"{defaults_help(ALGORITHM_DEFAULTS, 'rpo_alpha')}; with the shipped models "
                                  f"{defaults_help(MEASURED, 'rpo_alpha')[len('default: '):]}", group="algorithm",
                                  min=0.0)
    precompute_ref_log_probs: bool = arg(False, "score every pair with the reference once, up front (cached on disk)",
                                         group="algorithm")
    max_new_tokens: int = arg(24, "completion limit of the greedy task evaluation (embedded task)",
                              group="logging", min=1)
    learning_rate: float = default(1e-6)  # TRL's
    lr_scheduler_type: str = default("linear")
    max_steps: int = default(60)
    output_dir: str = default("outputs/dpo_text")


def main(cfg: DPOTextConfig) -> dict:
    register()  # the demo worlds by name: data set 'embedded', the shape verifiers, GenEval's 'shapes' backend
    check_model_kind(cfg.model_name_or_path, ("text", "vision"))  # a model of another kind: one line, now
    start = time.time()
    shipped = origin(cfg)["model"] is not None  # parse_config found the model among MODEL_DEFAULTS
    loss, knobs, params = pair_loss(cfg, MEASURED if shipped else ALGORITHM_DEFAULTS)
    if shipped and cfg.rpo_alpha is None and knobs["rpo_alpha"]:
        print(f"rpo_alpha={knobs['rpo_alpha']}: measured on the shipped model {cfg.model_name_or_path!r} "
              f"(--rpo_alpha 0: {cfg.algorithm} without the chosen side's NLL)")
    check_masked_diffusion_source(cfg)  # a Hub masked-diffusion LM: remote code allowed, reachable (before the data)
    task = TASKS.get(cfg.dataset_name)  # correct vs wrong final answers on an embedded task (arithmetic; VLM)
    train, held_out, data_info = load_pair_data(cfg)
    if has_images(train + held_out):  # image + prompt + chosen / rejected (RLAIF-V): images read and checked now
        train, held_out = with_images(train, cfg, "train", data_info), with_images(held_out, cfg, "eval", data_info)
    policy = masked_diffusion_policy(cfg, model_path(cfg.model_name_or_path), "elbo_mc")  # VRPO's ELBO
    if (policy is not None) != (cfg.algorithm == "vrpo"):
        raise UserError(f"--algorithm {cfg.algorithm}: vrpo is DPO for masked-diffusion LMs, and "
                        f"{cfg.model_name_or_path} is {'' if policy is not None else 'not '}one (use "
                        f"{'vrpo' if policy is not None else 'dpo'})")
    policy = policy or load_policy(model_path(cfg.model_name_or_path), cfg.freeze_vision, **cfg.model_kwargs(),
                                   max_new_tokens=cfg.max_new_tokens, chat_template=cfg.chat_template)
    train, held_out = fit_pairs(policy.tokenizer, prompt_token_counter(policy), train, held_out, cfg, data_info)
    objective = DPOObjective(policy, knobs["beta"], loss, cfg.label_smoothing, cache_reference=cfg.precompute_ref_log_probs,
                             rpo_alpha=knobs["rpo_alpha"], loss_params=params)
    task_score = (lambda: greedy_task_score(policy, cfg, task)) if task else None  # noqa: E731
    return train_pair_run(cfg, objective, train, held_out, data_info, start, task_score, {"pair_loss": loss, **knobs})


if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_config(DPOTextConfig))
