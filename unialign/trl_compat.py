"""TRL's vocabulary: the ``GRPOConfig`` / ``DPOConfig`` / ``RewardConfig`` (and TRL scripts' ``ModelConfig`` /
``ScriptArguments``) names a TRL user sets, as flags, YAML keys and Python keywords.

A TRL name that is also a unialign field (``learning_rate``, ``beta``, ``num_generations``, ...) is that field, with
TRL's meaning. Every other name a TRL user commonly sets is in ``TRL_NAMES``, one of three kinds:

* ``alias``: works under TRL's name with TRL's meaning, translated into unialign fields (``--lora_r 8`` is
  ``--lora_rank 8``; ``--per_device_train_batch_size 16 --gradient_accumulation_steps 4`` with 8 generations is
  ``--micro_batch_size 16 --prompts_per_step 8``: TRL's generation batch, 64 completions, per optimizer step);
* ``ignored``: accepted and not needed, because unialign always does what it asks (``--log_completions``);
* ``refused``: one line naming the unialign way to say it (``--num_train_epochs``: unialign counts steps).

``translate`` applies the table; ``unialign.config.parse_config`` calls it for unknown flags and YAML keys, the
TRL-style ``unialign.GRPOConfig`` / ``DPOConfig`` for keywords. ``migration_table()`` writes the docs' table
(``docs/trl_migration.md``; ``python -m unialign.trl_compat`` prints it), so the docs cannot drift from the code.
A config class may also rename one of its own fields the TRL way with a class attribute ``ALIASES`` (TRL name ->
field): the GRPO scripts' ``max_completion_length`` is their ``max_new_tokens``, the generation length, as in TRL.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from unialign.errors import UserError


@dataclasses.dataclass(frozen=True)
class TrlName:
    """One TRL name: ``kind`` alias / ignored / refused; ``configs`` the TRL classes that have it (for the docs);
    ``unialign`` the unialign spelling (for the docs and the refusal); ``note`` one line; ``apply(value, ctx)``
    (alias only) the unialign field values it sets."""

    name: str
    kind: str
    configs: str
    unialign: str
    note: str
    apply: Callable[[Any, Context], dict[str, Any]] | None = None


@dataclasses.dataclass
class Context:
    """What an alias may read: the config class's fields, the unialign values set so far (preset, YAML, flags
    or keywords), and every TRL name given with its value."""

    fields: Mapping[str, dataclasses.Field]
    values: Mapping[str, Any]
    trl: Mapping[str, Any]

    def current(self, name: str) -> Any:
        """The value field ``name`` has so far: set, else its default."""
        if name in self.values:
            return self.values[name]
        f = self.fields[name]
        return f.default if f.default is not dataclasses.MISSING else None


def _bool(name: str, value: Any) -> bool:
    from unialign.values import _to_bool

    try:
        return _to_bool(value)
    except ValueError as err:
        raise UserError(f"--{name}: {err}") from None


def _int(name: str, value: Any, minimum: int = 1) -> int:
    from unialign.values import convert

    try:
        out = convert(value, int, False)
    except ValueError as err:
        raise UserError(f"--{name}: {err}") from None
    if out < minimum:
        raise UserError(f"--{name}: must be >= {minimum}, got {out}")
    return out


def _float(name: str, value: Any) -> float:
    from unialign.values import convert

    try:
        return convert(value, float, False)
    except ValueError as err:
        raise UserError(f"--{name}: {err}") from None


def _rename(name: str, field: str, conv: Callable[[str, Any], Any] | None = None):
    return lambda value, ctx: {field: conv(name, value) if conv else value}


def _world_size() -> int:
    """Processes of this launch (accelerate / torchrun set WORLD_SIZE): TRL's per-device sizes count one of them."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _batch(value: Any, ctx: Context) -> dict[str, Any]:
    """TRL's ``per_device_train_batch_size`` (samples per device per forward/backward; when only
    ``gradient_accumulation_steps`` is given, the script's ``micro_batch_size``) and
    ``gradient_accumulation_steps`` (forward/backwards per optimizer step, default 1). Online (GRPO): TRL samples
    ``per_device x accumulation x processes`` completions per optimizer step (its generation batch with
    ``steps_per_generation`` left at its default), ``num_generations`` per prompt, so ``prompts_per_step`` is that
    over ``num_generations`` (divisible, TRL's rule too). Pairs (DPO, reward model): ``batch_size`` pairs per
    optimizer step."""
    per_device = (_int("per_device_train_batch_size", ctx.trl["per_device_train_batch_size"])
                  if "per_device_train_batch_size" in ctx.trl else ctx.current("micro_batch_size"))
    accumulation = (_int("gradient_accumulation_steps", ctx.trl["gradient_accumulation_steps"])
                    if "gradient_accumulation_steps" in ctx.trl else 1)
    total = per_device * accumulation * _world_size()
    if "prompts_per_step" in ctx.fields:
        g = int(ctx.current("num_generations"))
        if total % g:
            raise UserError(f"--per_device_train_batch_size x --gradient_accumulation_steps x processes = {total} "
                            f"completions per step is not a multiple of --num_generations {g} (TRL's rule too)")
        return {"micro_batch_size": per_device, "prompts_per_step": total // g}
    return {"micro_batch_size": per_device, "batch_size": total}


def _warmup_ratio(value: Any, ctx: Context) -> dict[str, Any]:
    ratio = _float("warmup_ratio", value)
    if not 0.0 <= ratio <= 1.0:
        raise UserError(f"--warmup_ratio: must be between 0 and 1, got {ratio}")
    return {"warmup_steps": math.ceil(ratio * int(ctx.current("max_steps")))}  # transformers' get_warmup_steps


def _use_peft(value: Any, ctx: Context) -> dict[str, Any]:
    if not _bool("use_peft", value):
        return {}
    rank = ctx.trl.get("lora_r")
    return {"lora_rank": _int("lora_r", rank) if rank is not None else (ctx.current("lora_rank") or 16)}


def _strategy(name: str, field: str):
    def apply(value: Any, ctx: Context) -> dict[str, Any]:
        value = str(value).lower()
        if value == "no":
            return {field: 0}
        if value == "steps":
            return {}
        raise UserError(f"--{name} {value}: unialign counts optimizer steps: --{field} N (0: "
                        f"{'before and after only' if field == 'eval_steps' else 'only the final checkpoint'})")
    return apply


def _vllm_mode(value: Any, ctx: Context) -> dict[str, Any]:
    if str(value) != "colocate":
        raise UserError(f"--vllm_mode {value}: unialign runs vLLM colocated in the training process only "
                        "(--generation_backend vllm); no separate vLLM server")
    return {"generation_backend": "vllm"}


def _refused(name: str, configs: str, unialign: str, note: str) -> TrlName:
    return TrlName(name, "refused", configs, unialign, note)


GRPO, DPO, RM, ALL, MODEL, SCRIPT = "GRPO", "DPO", "Reward", "GRPO, DPO, Reward", "ModelConfig", "ScriptArguments"

TRL_NAMES: dict[str, TrlName] = {t.name: t for t in [
    # --- batch and length
    TrlName("per_device_train_batch_size", "alias", ALL, "--micro_batch_size, --prompts_per_step / --batch_size",
            "samples per forward/backward; with --gradient_accumulation_steps and the processes, TRL's samples per "
            "optimizer step (GRPO: completions, so --prompts_per_step = that / --num_generations)", _batch),
    TrlName("gradient_accumulation_steps", "alias", ALL, "--prompts_per_step / --batch_size",
            "forward/backwards per optimizer step: multiplies the samples per step (see the row above)", _batch),
    _refused("num_train_epochs", ALL, "--max_steps",
             "unialign counts optimizer steps: --max_steps N (an epoch is rows / --prompts_per_step steps, or rows "
             "/ --batch_size for pairs)"),
    TrlName("warmup_ratio", "alias", ALL, "--warmup_steps", "warm-up as a share of --max_steps (rounded up)",
            _warmup_ratio),
    _refused("steps_per_generation", GRPO, "--num_mini_batches",
             "one generation batch (--prompts_per_step x --num_generations) per step; --num_mini_batches splits it "
             "into that many optimizer steps"),
    _refused("generation_batch_size", GRPO, "--prompts_per_step",
             "the generation batch is --prompts_per_step x --num_generations completions"),
    _refused("max_length", "DPO", "--max_prompt_length, --max_completion_length",
             "prompt and completion are limited separately: --max_prompt_length and --max_completion_length"),
    # --- precision, engines
    TrlName("bf16", "alias", ALL, "--mixed_precision bf16",
            "bf16 autocast over the weights' dtype, as TRL (--torch_dtype bfloat16 loads the weights in bfloat16)",
            lambda v, ctx: {"mixed_precision": "bf16" if _bool("bf16", v) else "no"}),
    TrlName("fp16", "alias", ALL, "--mixed_precision fp16", "fp16 autocast over the weights' dtype (a GPU), as TRL",
            lambda v, ctx: {"mixed_precision": "fp16" if _bool("fp16", v) else "no"}),
    TrlName("use_vllm", "alias", GRPO, "--generation_backend vllm",
            "rollouts from vLLM (colocated in the training process)",
            lambda v, ctx: {"generation_backend": "vllm" if _bool("use_vllm", v) else "hf"}),
    TrlName("vllm_mode", "alias", GRPO, "--generation_backend vllm",
            "colocate only (no separate vLLM server)", _vllm_mode),
    TrlName("dtype", "alias", MODEL, "--torch_dtype", "the dtype the weights are loaded in",
            _rename("dtype", "torch_dtype")),
    # --- PEFT (TRL scripts' ModelConfig)
    TrlName("use_peft", "alias", MODEL, "--lora_rank", "train a LoRA (rank --lora_r, TRL's default 16)", _use_peft),
    TrlName("lora_r", "alias", MODEL, "--lora_rank", "LoRA rank", _rename("lora_r", "lora_rank", _int)),
    _refused("lora_alpha", MODEL, "(2 x --lora_rank)",
             "this script's LoRA scales by alpha = 2 x rank; the text and image RL / DPO scripts have --lora_alpha"),
    _refused("lora_target_modules", MODEL, "(all linear layers)",
             "this script's LoRA goes on every linear layer; the text scripts have --lora_target_modules"),
    _refused("load_in_4bit", MODEL, "(none)", "quantised (QLoRA) training is not supported"),
    _refused("attn_implementation", MODEL, "(none)",
             "this script loads the model's default attention (SDPA); the text scripts have --attn_implementation"),
    _refused("gradient_checkpointing", ALL, "(none)",
             "this script keeps activations; the text scripts and dpo_sdxl.py have --gradient_checkpointing"),
    # --- data (TRL scripts' ScriptArguments)
    TrlName("dataset_train_split", "alias", SCRIPT, "--train_split", "training split",
            _rename("dataset_train_split", "train_split")),
    TrlName("dataset_test_split", "alias", SCRIPT, "--eval_split", "held-out split",
            _rename("dataset_test_split", "eval_split")),
    TrlName("per_device_eval_batch_size", "alias", ALL, "--eval_batch_size", "rows per held-out evaluation batch",
            _rename("per_device_eval_batch_size", "eval_batch_size", _int)),
    # --- logging, evaluation, checkpoints
    TrlName("eval_strategy", "alias", ALL, "--eval_steps", "'no' (before and after only) or 'steps'",
            _strategy("eval_strategy", "eval_steps")),
    TrlName("save_strategy", "alias", ALL, "--save_steps", "'no' (only final/) or 'steps'",
            _strategy("save_strategy", "save_steps")),
    _refused("logging_dir", ALL, "--output_dir", "TensorBoard logs go under --output_dir"),
    _refused("run_name", ALL, "--output_dir", "a run is named by its --output_dir"),
    _refused("push_to_hub", ALL, "(none)",
             "upload <output_dir>/final with huggingface_hub: HfApi().upload_folder(folder_path=..., repo_id=...)"),
    _refused("hub_model_id", ALL, "(none)", "see push_to_hub"),
    TrlName("log_completions", "ignored", GRPO, "(always)",
            "sample completions are written at every evaluation (completions.jsonl and the tracker)"),
    _refused("num_completions_to_print", GRPO, "(none)", "see completions.jsonl in --output_dir"),
    # --- algorithm
    TrlName("center_rewards_coefficient", "alias", RM, "--center_coef", "weight of the mean-zero reward penalty",
            _rename("center_rewards_coefficient", "center_coef", _float)),
    _refused("sync_ref_model", "GRPO, DPO", "(none)", "the reference model stays the initial model (TR-DPO not built)"),
    _refused("delta", GRPO, "--dual_clip", "two-sided clipping of negative advantages: --dual_clip (Dual-clip PPO's c)"),
    _refused("reference_free", DPO, "(none)", "DPO always uses the reference model here (SimPO: --loss_type simpo)"),
    _refused("model_init_kwargs", "GRPO, DPO", "--torch_dtype", "the model is loaded with --torch_dtype only"),
    _refused("ref_model_init_kwargs", DPO, "--torch_dtype", "the reference is the initial model, same dtype"),
    TrlName("use_liger_loss", "ignored", GRPO, "(always)",
            "the loss already runs through a fused head: no [batch, length, vocabulary] logits"),
    TrlName("use_liger_kernel", "ignored", ALL, "(always)", "see use_liger_loss"),
    TrlName("remove_unused_columns", "ignored", ALL, "(always kept)", "every column reaches the reward functions"),
    TrlName("dataloader_num_workers", "ignored", ALL, "(none)", "rows are read in the main process"),
]}


def translate(cls: type, trl: Mapping[str, Any], values: Mapping[str, Any], where: str = "",
              context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The unialign field values of the TRL names ``trl`` (name -> value) for config class ``cls``; ``values`` are
    the unialign values given beside them (same source), ``context`` (default ``values``) all values set so far,
    which the aliases read. ``UserError`` for a refused name (naming the unialign way), for an alias this config
    has no field for, and for a TRL name that contradicts a unialign value given beside it (give one)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    ctx = Context(fields, values if context is None else context, trl)
    out: dict[str, Any] = {}
    for name, value in trl.items():
        entry = TRL_NAMES[name]
        if entry.kind == "refused":
            raise UserError(f"{where}--{name} (TRL's name): {entry.note}")
        if entry.kind == "ignored":
            continue
        for key, new in entry.apply(value, ctx).items():
            if key not in fields:
                raise UserError(f"{where}--{name} (TRL's name): this script has no {entry.unialign} setting")
            if key in values and values[key] != new and str(values[key]) != str(new):
                raise UserError(f"{where}--{name} {value} means --{key} {new}, but --{key} {values[key]} is also "
                                "given; give one")
            out[key] = new
    return out


def field_aliases(cls: type) -> dict[str, str]:
    """``cls.ALIASES``: TRL name -> the class's own field it stands for (checked: the field exists)."""
    aliases = dict(getattr(cls, "ALIASES", {}))
    names = {f.name for f in dataclasses.fields(cls)}
    for alias, target in aliases.items():
        if target not in names:
            raise TypeError(f"{cls.__name__}.ALIASES: {alias!r} -> {target!r}, which is not a field")
    return aliases


# The TRL fields a user commonly sets, per TRL config: the docs' table lists every one (a test checks each is a
# unialign field, a class alias or a TRL_NAMES entry of its script).
COMMON = {
    "GRPOConfig": ["output_dir", "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps",
                   "num_train_epochs", "max_steps", "num_generations", "max_prompt_length", "max_completion_length",
                   "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "beta", "epsilon", "epsilon_high",
                   "delta", "loss_type", "scale_rewards", "num_iterations", "importance_sampling_level",
                   "mask_truncated_completions", "reward_weights", "steps_per_generation", "generation_batch_size",
                   "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "bf16", "fp16", "gradient_checkpointing",
                   "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay", "max_grad_norm", "optim",
                   "adam_beta1", "adam_beta2", "adam_epsilon", "seed", "logging_steps", "logging_dir", "run_name",
                   "eval_strategy", "eval_steps", "per_device_eval_batch_size", "save_strategy", "save_steps",
                   "save_total_limit", "report_to", "resume_from_checkpoint", "overwrite_output_dir", "push_to_hub",
                   "hub_model_id", "log_completions", "num_completions_to_print", "sync_ref_model",
                   "model_init_kwargs", "use_liger_loss", "remove_unused_columns", "dataloader_num_workers"],
    "DPOConfig": ["output_dir", "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps",
                  "num_train_epochs", "max_steps", "beta", "loss_type", "label_smoothing", "rpo_alpha", "max_length",
                  "max_prompt_length", "max_completion_length", "precompute_ref_log_probs", "reference_free",
                  "sync_ref_model", "ref_model_init_kwargs", "bf16", "gradient_checkpointing", "lr_scheduler_type",
                  "warmup_ratio", "warmup_steps", "weight_decay", "max_grad_norm", "optim", "seed", "logging_steps",
                  "eval_strategy", "eval_steps", "per_device_eval_batch_size", "save_strategy", "save_steps",
                  "save_total_limit", "report_to", "resume_from_checkpoint", "push_to_hub", "use_liger_kernel"],
    "RewardConfig": ["output_dir", "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps",
                     "num_train_epochs", "max_steps", "max_length", "center_rewards_coefficient", "bf16",
                     "gradient_checkpointing", "lr_scheduler_type", "warmup_ratio", "weight_decay", "seed",
                     "logging_steps", "eval_strategy", "eval_steps", "save_steps", "report_to", "push_to_hub"],
    "ModelConfig / ScriptArguments": ["model_name_or_path", "dtype", "torch_dtype", "use_peft", "lora_r",
                                      "lora_alpha", "lora_target_modules", "load_in_4bit", "trust_remote_code",
                                      "attn_implementation", "dataset_name", "dataset_config", "dataset_train_split",
                                      "dataset_test_split"],
}


def describe(name: str, cls: type) -> tuple[str, str]:
    """(unialign spelling, what it does) of TRL's ``name`` for the config class ``cls``, or ("", "") when ``cls``
    has nothing for it."""
    fields = {f.name for f in dataclasses.fields(cls)}
    aliases = field_aliases(cls)
    if name in aliases:
        return f"--{aliases[name]}", f"same meaning: this script's name for it is --{aliases[name]}"
    if name in fields:
        return f"--{name}", "same name, same meaning"
    if name in TRL_NAMES:
        entry = TRL_NAMES[name]
        return entry.unialign, {"alias": "works: ", "ignored": "not needed: ", "refused": "refused: "}[entry.kind] + entry.note
    return "", ""


def migration_table(classes: Mapping[str, type]) -> str:
    """The docs' TRL -> unialign table (Markdown): for each TRL config in ``COMMON``, each field with its unialign
    spelling in the config class ``classes[trl_config]`` (a script's config) and what it does there."""
    lines = ["# From TRL to unialign", "",
             "Generated by `python -m unialign.trl_compat` from `unialign/trl_compat.py` and the scripts' configs "
             "(a test checks this file is current). Every name below is accepted as a flag, a YAML key and a "
             "keyword of `unialign.GRPOConfig` / `unialign.DPOConfig`: *works* names do what they do in TRL, "
             "*not needed* names are accepted and change nothing, *refused* names stop the run with the line "
             "shown, before any model loads.", ""]
    for trl_config, names in COMMON.items():
        cls = classes[trl_config]
        lines += [f"## {trl_config} (`{cls.__name__}`)", "", "| TRL | unialign | what it does here |", "|---|---|---|"]
        for name in names:
            spelling, what = describe(name, cls)
            what = what.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")  # <output_dir> is no HTML tag
            lines.append(f"| `{name}` | {spelling} | {what} |")
        lines.append("")
    return "\n".join(lines)


def script_configs() -> dict[str, type]:
    """The config classes the table documents: the GRPO, DPO and reward-model scripts' (loaded from scripts/)."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "scripts"

    def load(name: str, cls: str) -> type:
        spec = importlib.util.spec_from_file_location(f"_unialign_script_{name}", root / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while building the class
        spec.loader.exec_module(module)
        return getattr(module, cls)

    grpo = load("grpo_math", "GRPOMathConfig")
    return {"GRPOConfig": grpo, "DPOConfig": load("dpo_text", "DPOTextConfig"),
            "RewardConfig": load("train_reward_model", "RewardModelConfig"), "ModelConfig / ScriptArguments": grpo}


if __name__ == "__main__":
    print(migration_table(script_configs()))


# ----------------------------------------------------------------------------- TRL's defaults
# The defaults of TRL's configs (TRL 1.16, checked against the installed package in tests/test_trl_defaults.py) that
# a unialign config with the same field can differ from, in unialign's spelling (loss_type: TRL's "dapo" is
# token_mean). A config says which TRL config it stands for with ``TRL_CONFIG`` (a class attribute).
_TRAINING = dict(lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, seed=42)
TRL_DEFAULTS: dict[str, dict[str, Any]] = {
    "GRPOConfig": dict(learning_rate=1e-6, **_TRAINING, gradient_checkpointing=True, beta=0.0, num_generations=8,
                       max_completion_length=512, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                       epsilon=0.2, loss_type="token_mean", scale_rewards="group", num_iterations=1),
    "RLOOConfig": dict(learning_rate=1e-6, **_TRAINING, gradient_checkpointing=True, beta=0.05, num_generations=2,
                       max_completion_length=512, temperature=1.0, epsilon=0.2, num_iterations=1),
    "DPOConfig": dict(learning_rate=1e-6, **_TRAINING, gradient_checkpointing=True, beta=0.1, loss_type="sigmoid"),
    "RewardConfig": dict(learning_rate=1e-4, **_TRAINING, gradient_checkpointing=True),
    "SFTConfig": dict(learning_rate=2e-5, **_TRAINING, gradient_checkpointing=True),
}
# Why a departure that is not a model's own default is kept (config, field) -> one line; each field has its row in
# docs/coming_from_trl.md's table (tests/test_trl_defaults.py).
TRL_DEPARTURES: dict[tuple[str, str], str] = {
    ("GRPOConfig", "loss_type"): "--algorithm grpo is GRPO as published (per-sequence token mean); TRL's is "
                                 "--loss_type dapo (or --algorithm dapo)",
    ("GRPOConfig", "beta"): "the grpo algorithm as published (DeepSeekMath) keeps KL to the reference; --beta 0 is "
                            "TRL's",
    ("RLOOConfig", "gradient_checkpointing"): "activations kept: the fused head already avoids [batch, length, "
                                              "vocabulary] logits; --gradient_checkpointing true is TRL's",
    ("GRPOConfig", "gradient_checkpointing"): "activations kept: the fused head already avoids [batch, length, "
                                              "vocabulary] logits; --gradient_checkpointing true is TRL's",
    ("RewardConfig", "gradient_checkpointing"): "activations kept (the embedded and small models need no "
                                                "recomputation); --gradient_checkpointing true is TRL's",
    ("SFTConfig", "gradient_checkpointing"): "activations kept: the fused head already avoids [batch, length, "
                                             "vocabulary] logits; --gradient_checkpointing true is TRL's",
    ("DPOConfig", "gradient_checkpointing"): "activations kept: the fused head already avoids [batch, length, "
                                             "vocabulary] logits; --gradient_checkpointing true is TRL's",
    ("DPOConfig", "seed"): "unialign seeds 0 by default; --seed 42 is TRL's",
    ("GRPOConfig", "seed"): "unialign seeds 0 by default; --seed 42 is TRL's",
    ("RewardConfig", "seed"): "unialign seeds 0 by default; --seed 42 is TRL's",
    ("SFTConfig", "seed"): "unialign seeds 0 by default; --seed 42 is TRL's",
}


def _resolved(cfg: Any, name: str) -> Any:
    """``cfg``'s value of ``name``, a knob left unset read from its algorithm (``cfg.algo_spec()``)."""
    value = getattr(cfg, name)
    if value is None and hasattr(cfg, "algo_spec"):
        value = getattr(cfg.algo_spec(), name, None)
    return value


def trl_departures(cfg: Any, record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Where ``cfg`` (a config whose class names its ``TRL_CONFIG``) differs from that TRL config's default in a field
    nobody set (``record``: ``unialign.config.origin(cfg)``): ``{"field", "value", "trl", "why"}`` each, ``why``
    "tuned for <model>" for a model's own default (``MODEL_DEFAULTS``), else ``TRL_DEPARTURES``' line. What the user
    set is theirs, never listed."""
    trl_config = getattr(type(cfg), "TRL_CONFIG", None)
    if trl_config is None:
        return []
    names = {f.name for f in dataclasses.fields(cfg)}
    aliases = field_aliases(type(cfg))
    out = []
    for trl_name, trl_value in TRL_DEFAULTS.get(trl_config, {}).items():
        name = aliases.get(trl_name, trl_name)  # the GRPO scripts' max_completion_length is their max_new_tokens
        if name not in names or name in record["set"]:
            continue
        value = _resolved(cfg, name)
        if value is None or value == trl_value:
            continue
        if name in record["model_defaults"]:
            why = f"tuned for the model {record['model']!r} (its measured default)"
        else:
            why = TRL_DEPARTURES.get((trl_config, trl_name), "unialign's default")
        out.append({"field": name, "value": value, "trl": trl_value, "why": why})
    return out
