"""Typed configs from the command line: one dataclass per script, optional YAML file, presets, validation.

``parse_config(Cls)`` reads ``--config file.yaml`` (keys are field names) and then command-line
flags, which win. A script's ``presets`` dict maps a preset name to field overrides applied
before the YAML and flags (so flags can still change a preset's value). The result is checked by
``validate`` before anything is loaded: every value against its field's type, and against the field's
rules, taken from its metadata or, for a field that declares none, from ``RULES`` by name:

    field(default=8, metadata={"help": "samples per prompt", "group": "algorithm", "min": 1})

``help`` (one line, shown by ``--help``), ``group`` (the ``--help`` section: one of ``GROUPS``),
``choices`` (allowed values), ``min`` / ``max`` (inclusive bounds), ``gt`` / ``lt`` (exclusive bounds).
A config with an ``output_dir`` gets it created and checked writable at once. Every failure is a
``UserError`` (a ValueError) naming the field; ``exit_on_user_error`` turns it into one line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import tempfile
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from unialign.errors import UserError
from unialign.values import _to_bool, convert  # noqa: F401 - re-exported: config.convert is the field converter

T = TypeVar("T")

GROUPS = {  # --help sections, in order
    "config": "run configuration (preset, YAML file)",
    "model": "model",
    "data": "data",
    "algorithm": "algorithm",
    "optimisation": "optimisation",
    "logging": "logging, evaluation and checkpoints",
}

DTYPES = ("float32", "float16", "bfloat16")
OPTIMIZERS = ("adamw_torch", "adafactor", "adamw_8bit")
SCHEDULERS = ("constant", "linear", "cosine")
REPORT_TO = ("tensorboard", "wandb", "mlflow", "comet_ml", "all", "none")


def _algorithms() -> tuple[str, ...]:
    from unialign.registry import ALGORITHMS

    return tuple(ALGORITHMS)


# Rules, --help groups and fallback help lines of the fields shared by many configs (the trainer configs',
# mostly), by name. A field's own metadata wins over this table. Choices given as a function are looked
# up when used.
RULES: dict[str, dict[str, Any]] = {
    # model
    "model_name_or_path": {"group": "model"}, "vae_name_or_path": {"group": "model"},
    "torch_dtype": {"group": "model", "choices": DTYPES}, "lora_rank": {"group": "model", "min": 0},
    "gradient_checkpointing": {"group": "model"}, "value_head": {"group": "model"},
    "generation_cache": {"group": "model", "choices": ("auto", "dynamic", "static")},
    "rollout_dtype": {"group": "model", "choices": DTYPES}, "generation_backend": {"group": "model", "choices": ("hf", "vllm")},
    "vllm_gpu_memory_utilization": {"group": "model", "gt": 0.0, "max": 1.0},
    "num_threads": {"group": "model"}, "system_prompt": {"group": "model"},
    "reward_model_path": {"group": "model"}, "resolution": {"group": "model", "min": 8},
    "model_family": {"group": "model"}, "lora_alpha": {"group": "model"}, "max_sequence_length": {"group": "model"},
    # data
    "dataset_name": {"group": "data"}, "dataset_config": {"group": "data"}, "train_split": {"group": "data"},
    "eval_split": {"group": "data"}, "eval_dataset_name": {"group": "data"},
    "eval_fraction": {"group": "data", "gt": 0.0, "lt": 1.0}, "num_eval": {"group": "data", "min": 1},
    "max_prompt_length": {"group": "data", "min": 1}, "max_completion_length": {"group": "algorithm", "min": 1, "help": 'completion length the loss normaliser assumes (Dr.GRPO, DAPO overlong buffer; default: max_new_tokens)'},
    "max_length": {"group": "data", "min": 1}, "overlong_rows": {"group": "data", "choices": ("error", "drop")},
    "prompt_set": {"group": "data"}, "num_prompts": {"group": "data", "min": 1},
    "pairs_per_prompt": {"group": "data", "min": 1}, "eval_pairs_per_prompt": {"group": "data", "min": 1},
    "min_gap": {"group": "data", "min": 0.0}, "num_eval_images": {"group": "data", "min": 1},
    "caption_dropout": {"group": "data", "min": 0.0, "max": 1.0},
    # algorithm
    "algorithm": {"group": "algorithm", "choices": _algorithms,
                  "help": "algorithm preset (unialign.registry); its knobs below override it one by one (a script's "
                          "own knob defaults apply to its default algorithm only: with another algorithm, unset knobs "
                          "take that algorithm's values)"},
    "reward_funcs": {"group": "algorithm"}, "reward": {"group": "algorithm"}, "reward_weights": {"group": "algorithm"},
    "reward_errors": {"group": "algorithm"}, "eval_reward": {"group": "algorithm"},
    "num_generations": {"group": "algorithm", "min": 1, "help": 'samples per prompt (G, the group)'}, "prompts_per_step": {"group": "algorithm", "min": 1, "help": 'prompts per step (P); each step samples P x G completions'},
    "max_new_tokens": {"group": "algorithm", "min": 1}, "temperature": {"group": "algorithm", "gt": 0.0},
    "top_p": {"group": "algorithm", "gt": 0.0, "max": 1.0}, "top_k": {"group": "algorithm", "min": 0},
    "max_generation_rounds": {"group": "algorithm", "min": 1, "help": 'DAPO dynamic sampling: sampling rounds per step to fill the batch'}, "ratio_check_tol": {"group": "algorithm", "gt": 0.0, "help": "tolerance of the first step's check that recomputed log-probs equal the sampled ones (default: by dtype)"},
    "beta": {"group": "algorithm", "min": 0.0}, "loss_type": {"group": "algorithm"},
    "label_smoothing": {"group": "algorithm", "min": 0.0, "lt": 0.5}, "rpo_alpha": {"group": "algorithm", "min": 0.0},
    "center_coef": {"group": "algorithm", "min": 0.0}, "precompute_ref_log_probs": {"group": "algorithm"},
    "num_steps": {"group": "algorithm", "min": 1}, "guidance_scale": {"group": "algorithm", "min": 0.0},
    "eta": {"group": "algorithm", "min": 0.0}, "noise_level": {"group": "algorithm"}, "sde_type": {"group": "algorithm"},
    "sde_window_size": {"group": "algorithm"}, "sde_window_range": {"group": "algorithm"}, "timestep_fraction": {"group": "algorithm", "gt": 0.0, "max": 1.0},
    "min_step_std": {"group": "algorithm", "min": 0.0}, "train_chunk_size": {"group": "optimisation", "min": 0},
    "sample_batch_size": {"group": "optimisation", "min": 0},
    "rollout_correction": {"group": "algorithm"}, "rollout_correction_level": {"group": "algorithm"},
    "rollout_correction_cap": {"group": "algorithm", "gt": 0.0},
    # optimisation
    "max_steps": {"group": "optimisation", "min": 1}, "learning_rate": {"group": "optimisation", "min": 0.0},
    "weight_decay": {"group": "optimisation", "min": 0.0}, "adam_beta1": {"group": "optimisation", "min": 0.0, "lt": 1.0},
    "adam_beta2": {"group": "optimisation", "min": 0.0, "lt": 1.0}, "adam_epsilon": {"group": "optimisation", "gt": 0.0},
    "optim": {"group": "optimisation", "choices": OPTIMIZERS},
    "lr_scheduler_type": {"group": "optimisation", "choices": SCHEDULERS},
    "warmup_steps": {"group": "optimisation", "min": 0}, "max_grad_norm": {"group": "optimisation", "gt": 0.0},
    "seed": {"group": "optimisation"}, "micro_batch_size": {"group": "optimisation", "min": 1, "help": 'samples (or pairs) per forward/backward'},
    "batch_size": {"group": "optimisation", "min": 1, "help": 'pairs per optimizer step'}, "num_mini_batches": {"group": "optimisation", "min": 1, "help": 'optimizer steps per batch of samples'},
    "allow_config_change": {"group": "optimisation"},
    # logging, evaluation, checkpoints
    "output_dir": {"group": "logging", "help": 'folder for checkpoints, logs, curves, summary.json and final/'}, "logging_steps": {"group": "logging", "min": 1},
    "save_steps": {"group": "logging", "min": 0}, "save_minutes": {"group": "logging", "min": 0.0},
    "overwrite_output_dir": {"group": "logging"}, "save_total_limit": {"group": "logging", "min": 0},
    "report_to": {"group": "logging", "choices": REPORT_TO}, "resume_from_checkpoint": {"group": "logging"},
    "eval_steps": {"group": "logging", "min": 0, "help": 'run the held-out evaluator every N steps (0: only before and after)'}, "eval_batch_size": {"group": "logging", "min": 1, "help": 'rows per held-out evaluation batch'},
    "eval_seed": {"group": "logging"}, "eval_timestep_samples": {"group": "logging", "min": 1},
    "preset": {"group": "config"}, "config": {"group": "config"},
}


def arg(default: Any, help: str, **rules: Any) -> Any:  # noqa: A002 - the metadata key argparse uses
    """A dataclass field with its ``--help`` line and rules: ``x: int = arg(8, "samples per prompt", min=1)``."""
    return dataclasses.field(default=default, metadata={"help": help, **rules})


# ------------------------------------------------------------------ field introspection
def _algo_knob_rules(cls: type, name: str) -> dict[str, Any]:
    """For an online config (one with ``algo_spec``), the rules of the ``AlgoSpec`` knob ``name`` (declared
    once in ``unialign.registry``), so a script that re-declares the field with its own default keeps them."""
    if not hasattr(cls, "algo_spec"):
        return {}
    from unialign.registry import AlgoSpec

    knob = {f.name: f for f in dataclasses.fields(AlgoSpec)}.get(name)
    return {**knob.metadata, "group": "algorithm"} if knob is not None and name != "name" else {}


def field_rules(cls: type, f: dataclasses.Field) -> dict[str, Any]:
    """The rules of one field: an algorithm knob's own (online configs), then ``RULES[name]``, then the
    field's metadata, each overriding the one before; callable choices resolved."""
    rules = {**_algo_knob_rules(cls, f.name), **RULES.get(f.name, {}), **dict(f.metadata)}
    if callable(rules.get("choices")):
        rules["choices"] = tuple(rules["choices"]())
    return rules


def field_type(cls: type, f: dataclasses.Field) -> tuple[type | None, bool]:
    """(base type among bool / int / float / str, or None for anything else; whether None is allowed)."""
    try:
        hint = typing.get_type_hints(cls).get(f.name, f.type)
    except Exception:  # noqa: BLE001 - unresolvable string annotations: fall back to the raw one
        hint = f.type
    if isinstance(hint, str):
        optional = "None" in hint
        names = [p.strip() for p in hint.split("|") if p.strip() != "None"]
        base = {"bool": bool, "int": int, "float": float, "str": str}.get(names[0]) if len(names) == 1 else None
        return base, optional
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        base = rest[0] if len(rest) == 1 and rest[0] in (bool, int, float, str) else None
        return base, len(rest) < len(args)
    return (hint if hint in (bool, int, float, str) else None), False


# ------------------------------------------------------------------ parsing
def build_parser(cls: type, prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser for ``cls``: one ``--flag`` per field, in ``GROUPS`` sections, each with its help
    line, choices and default. Values stay strings here (``parse_config`` converts and checks them)."""
    doc = getattr(sys.modules.get(cls.__module__), "__doc__", None)  # the script's docstring: usage examples
    from unialign.trl_compat import field_aliases

    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [-h] [--preset NAME] [--config FILE.yaml] [--FIELD VALUE ...]",
                                     allow_abbrev=False,  # --lr must not quietly mean --lr_scheduler_type
                                     epilog="TRL's names (--per_device_train_batch_size, --lora_r, --warmup_ratio, "
                                            "...) are accepted too, or refused naming the unialign flag: "
                                            "docs/trl_migration.md")
    sections = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    aliases = field_aliases(cls)
    for f in dataclasses.fields(cls):
        if f.name in aliases:  # a field renamed the TRL way: set through its alias below
            continue
        rules = field_rules(cls, f)
        base, optional = field_type(cls, f)
        section = sections.get(rules.get("group"))
        if section is None:
            section = sections.setdefault("other", parser.add_argument_group("other"))
        text = rules.get("help", "")
        if rules.get("choices"):
            text += f" [one of: {', '.join(map(str, rules['choices']))}]"
        default = f.default if f.default is not dataclasses.MISSING else None
        if "(default:" not in text:
            text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
        if base is bool:
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        else:
            kwargs["metavar"] = {int: "INT", float: "FLOAT"}.get(base, "STR")
        section.add_argument(f"--{f.name}", **kwargs)
        for alias in (a for a, target in aliases.items() if target == f.name):
            section.add_argument(f"--{alias}", dest=f"{ALIAS_DEST}{alias}", default=argparse.SUPPRESS,
                                 metavar=kwargs["metavar"], help=f"TRL's name for --{f.name} (same meaning)")
    return parser


ALIAS_DEST = "alias:"  # argparse dest of a class alias's flag (``cls.ALIASES``), resolved by ``parse_config``


def _split_unknown(tokens: list[str]) -> dict[str, str]:
    """``--name value`` / ``--name=value`` / a bare ``--name`` (true) of the flags argparse did not know, by name;
    a stray value is a ``UserError``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise UserError(f"unrecognized argument {token!r} (flags are --FIELD VALUE)")
        name, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value, i = tokens[i + 1], i + 1
            else:
                value = "true"
        out[name] = value
        i += 1
    return out


def resolve_names(cls: type, given: dict[str, Any], where: str = "", before: dict[str, Any] | None = None) -> dict[str, Any]:
    """``given`` (name -> value, from one source: flags, a YAML file, keywords) with the names of ``cls``'s fields
    kept, its class aliases (``cls.ALIASES``) renamed to their fields, and TRL's names (``unialign.trl_compat``)
    translated into unialign fields. ``UserError`` for a name that is none of these (with the closest known name),
    for a refused TRL name (naming the unialign way) and for an alias given beside its field with another value.
    ``before``: the values earlier sources set (a preset, the YAML file), which TRL's names read (the number of
    generations, the steps)."""
    from unialign.errors import did_you_mean
    from unialign.trl_compat import TRL_NAMES, field_aliases, translate

    fields = {f.name for f in dataclasses.fields(cls)}
    aliases = field_aliases(cls)
    own = {k: v for k, v in given.items() if k in fields and k not in aliases}
    trl: dict[str, Any] = {}
    for name, value in given.items():
        if name in aliases:
            target = aliases[name]
            if target in given and str(given[target]) != str(value):
                raise UserError(f"{where}--{name} is TRL's name for --{target}; both are given ({value} and "
                                f"{given[target]}): give one")
            own[target] = value
        elif name in fields:  # the config's own field wins over a TRL name it shares
            continue
        elif name in TRL_NAMES:
            trl[name] = value
        else:
            known = sorted((fields - set(aliases)) | set(aliases) | set(TRL_NAMES))
            hint = did_you_mean(name, known)
            raise UserError(f"{where}unknown config keys [{name!r}]{hint}" if where else
                            f"unknown flag --{name}{hint}; see --help")
    return {**own, **translate(cls, trl, own, where, {**(before or {}), **own})} if trl else own


def parse_config(cls: type[T], argv: list[str] | None = None, presets: dict[str, dict[str, Any]] | None = None,
                 check: Callable[[T], None] | None = None) -> T:
    """Build ``cls`` from defaults < preset < YAML < command-line flags, then ``validate`` it and run the
    script's own ``check``. Unknown flags exit 2 (argparse); unknown YAML keys, values of the wrong type
    or outside their rules raise ``UserError`` naming the field."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed, unknown = build_parser(cls).parse_known_args(argv)
    given = {(k[len(ALIAS_DEST):] if k.startswith(ALIAS_DEST) else k): v for k, v in vars(parsed).items()}
    flags = {**given, **_split_unknown(unknown)}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    preset = given.get("preset")
    if preset:
        if not presets or preset not in presets:
            raise UserError(f"--preset: unknown preset {preset!r}; choose one of {sorted(presets or {})}")
        values.update(presets[preset])
    config_file = given.get("config")
    if config_file:
        values.update(resolve_names(cls, _read_yaml(config_file, fields), f"{config_file}: ", values))
    given = resolve_names(cls, flags, "", values)
    values.update(given)
    _algorithm_knobs_follow_the_algorithm(cls, fields, values)
    out = {}
    for name, value in values.items():
        try:
            out[name] = convert(value, *field_type(cls, fields[name]))
        except ValueError as err:
            where = f"{config_file}: " if name not in given and config_file else ""
            raise UserError(f"{where}--{name}: {err}") from None
    cfg = cls(**out)
    validate(cfg)
    if check is not None:
        check(cfg)
    return cfg


def _algorithm_knobs_follow_the_algorithm(cls: type, fields: dict[str, dataclasses.Field], values: dict[str, Any]) -> None:
    """A script's own defaults for algorithm knobs (``grpo_image.py``'s clip 1e-2 and beta 0.1, ...) are tuned for
    the script's default ``algorithm``. When a preset, YAML or the command line picks another algorithm, every knob
    nobody set falls back to None: the chosen algorithm's published value (``unialign.registry``), so
    ``--algorithm flow_grpo`` trains Flow-GRPO, not Flow-GRPO with the script's GRPO clip. A script may still
    measure its own values for another algorithm: ``cls.ALGORITHM_DEFAULTS[algorithm]`` (field -> value) fills
    those fields nobody set. Only online configs (those with ``algo_spec``); ``values`` (what was set, by name) is
    updated in place."""
    algorithm = fields.get("algorithm")
    if not hasattr(cls, "algo_spec") or algorithm is None or values.get("algorithm", algorithm.default) == algorithm.default:
        return
    from unialign.registry import AlgoSpec

    for knob in (f.name for f in dataclasses.fields(AlgoSpec) if f.name != "name"):
        if knob in fields and knob not in values and fields[knob].default is not None:
            values[knob] = None
    # a script's own defaults for a non-default algorithm (its measured choices there), under what was set
    for name, value in getattr(cls, "ALGORITHM_DEFAULTS", {}).get(values.get("algorithm"), {}).items():
        if values.get(name) is None and name in fields:
            values[name] = value


def _read_yaml(path: str, fields: dict[str, dataclasses.Field]) -> dict[str, Any]:
    """The mapping of ``--config path``, safe-loaded (plain YAML types only); a key given twice in one mapping is
    an error naming it and its lines (``yaml.safe_load`` keeps the last silently)."""
    import yaml

    class DuplicateKey(yaml.YAMLError):
        pass

    class UniqueKeySafeLoader(yaml.SafeLoader):  # SafeLoader: still no arbitrary Python objects
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: merged keys may be overridden
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error below names it
                    continue
                if first is not None:
                    raise DuplicateKey(f"key {key!r} is given twice (lines {first} and {line}); keep one")
                seen[key] = line
            return super().construct_mapping(node, deep)

    try:
        with open(path) as f:
            loaded = yaml.load(f, Loader=UniqueKeySafeLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise UserError(f"--config: no such file {path!r}") from None
    except DuplicateKey as err:
        raise UserError(f"--config {path}: {err}") from None
    except yaml.YAMLError as err:
        raise UserError(f"--config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"--config {path}: expected a mapping of field names to values, got {type(loaded).__name__}")
    return loaded


# ------------------------------------------------------------------ validation
def validate(cfg: Any) -> None:
    """Check every field of the dataclass ``cfg`` against its type and rules (see the module docstring),
    the online algorithm settings when ``cfg`` has ``algo_spec``, and make sure ``output_dir`` (when
    present) is a writable directory. Raises ``UserError`` naming the first bad field."""
    cls = type(cfg)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        base, optional = field_type(cls, f)
        try:
            converted = convert(value, base, optional)
        except ValueError as err:
            raise UserError(f"--{f.name}: {err}") from None
        if converted != value or type(converted) is not type(value):
            setattr(cfg, f.name, converted)
        if converted is not None:
            _check_rules(f.name, converted, field_rules(cls, f))
    if hasattr(cfg, "algo_spec"):
        check_online(cfg)
    check_tracker(getattr(cfg, "report_to", None))
    if hasattr(cfg, "resume_from_checkpoint") and hasattr(cfg, "output_dir"):  # a training run's directory
        from unialign.trainers import rundir
        from unialign.trainers.common import find_checkpoint

        if not str(cfg.output_dir).strip():
            rundir.check(cfg.output_dir, False, False)  # the one line for an empty name
        check_output_dir(cfg.output_dir)
        rundir.check(cfg.output_dir, bool(cfg.resume_from_checkpoint), bool(getattr(cfg, "overwrite_output_dir", False)))
        if cfg.resume_from_checkpoint:  # "latest" with nothing to resume, or a damaged checkpoint: say so now
            try:
                find_checkpoint(cfg.output_dir, cfg.resume_from_checkpoint, max_steps=getattr(cfg, "max_steps", None))
            except ValueError as err:
                raise UserError(str(err)) from None
    elif getattr(cfg, "output_dir", None):
        check_output_dir(cfg.output_dir)


# --report_to value -> the package accelerate's tracker imports ("all" takes whichever are installed)
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
                    "comet_ml": ("comet_ml",)}


def check_tracker(report_to: str | None) -> None:
    """A tracker whose package is not installed is a ``UserError`` now, not a run that trains without any log
    (accelerate skips an unavailable tracker silently)."""
    import importlib.util

    packages = TRACKER_PACKAGES.get(str(report_to))
    if packages and not any(importlib.util.find_spec(p) is not None for p in packages):
        raise UserError(f"--report_to {report_to}: the {packages[0]} package is not installed (pip install "
                        f"{packages[0]}), so nothing would be logged; or --report_to tensorboard / none")


def _check_rules(name: str, value: Any, rules: dict[str, Any]) -> None:
    choices = rules.get("choices")
    if choices and value not in choices:
        from unialign.errors import did_you_mean
        from unialign.registry import IMAGE_ONLY

        if name == "algorithm" and value in IMAGE_ONLY:  # a text script asked for a denoiser's preset
            raise UserError(f"--algorithm: {value!r} is a preset for diffusion models (scripts/grpo_image.py, "
                            f"scripts/ddpo_aesthetic.py); this script's: {', '.join(map(str, choices))}")
        raise UserError(f"--{name}: {value!r} is not one of {', '.join(map(str, choices))}"
                        f"{did_you_mean(value, choices)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{name}: must be a finite number, got {value}")
        for key, ok, words in (("min", lambda b: value >= b, ">="), ("max", lambda b: value <= b, "<="),
                               ("gt", lambda b: value > b, ">"), ("lt", lambda b: value < b, "<")):
            if key in rules and not ok(rules[key]):
                raise UserError(f"--{name}: must be {words} {rules[key]}, got {value}")


def check_online(cfg: Any) -> None:
    """The online algorithm's settings as the trainer will see them: the algorithm, its overrides, the loss
    aggregation and KL estimator, group sizes and DAPO's overlong buffer."""
    from unialign.algos.aggregate import AGGREGATION_ALIASES
    from unialign.algos.kl import CLOSED_FORM_ESTIMATORS, KL_ALIASES

    try:
        spec = cfg.algo_spec()
    except (ValueError, TypeError) as err:
        raise UserError(f"--algorithm: {err}") from None
    if spec.loss_type not in AGGREGATION_ALIASES:
        raise UserError(f"--loss_type: {spec.loss_type!r} is not one of {', '.join(AGGREGATION_ALIASES)}")
    if spec.kl_estimator not in KL_ALIASES and spec.kl_estimator not in CLOSED_FORM_ESTIMATORS:
        raise UserError(f"--kl_estimator: {spec.kl_estimator!r} is not one of "
                        f"{', '.join([*KL_ALIASES, *CLOSED_FORM_ESTIMATORS])}")
    if cfg.num_generations < 2 and spec.advantage in ("group", "rloo"):
        raise UserError(f"--num_generations: must be >= 2 for {spec.name} (group baselines), got {cfg.num_generations}")


def check_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and parents) if needed and prove it is a writable directory by writing a file in it.
    Raises ``UserError`` when it is an existing file or cannot be created or written."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir: {str(out)!r} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        raise UserError(f"--output_dir: {str(out)!r} is not a writable directory ({err.strerror or err})") from None
    return out


@contextlib.contextmanager
def exit_on_user_error():
    """Turn the errors a user can fix (missing hub access, bad data, bad config) into a one-line
    message and exit status 2, instead of a stack trace from deep inside a library."""
    from unialign.hub import HubUnavailableError

    try:
        yield
    except (HubUnavailableError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
