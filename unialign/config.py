"""Typed configs from the command line: one dataclass per script, optional YAML file, presets, validation.

A config is a dataclass whose fields are declared with ``arg``: the default, the one ``--help`` line and the
field's rules, beside it::

    num_generations: int = arg(8, "samples per prompt (the group size G)", group="algorithm", min=1)

``group`` (the ``--help`` section: one of ``GROUPS``), ``check`` (a function of the value that raises ValueError
when the value does not read, e.g. a list written in a string), ``choices`` (the allowed values: a tuple, or a registry --
a dict, or a function returning the names -- read when checked, so names registered later count), ``min`` / ``max``
(inclusive bounds), ``gt`` / ``lt`` (exclusive bounds), ``hint`` (for a value outside ``choices``, a function of
(value, choices) giving the message instead of the plain refusal, or None). A class that declares a field again (a
script changing a default or a help line) keeps the rules of the field it overrides and may add or change some.

``parse_config(Cls)`` reads ``--config file.yaml`` (keys are field names) and then command-line flags, which
win. A script's ``presets`` dict maps a preset name to field overrides applied before the YAML and flags (so flags
can still change a preset's value). The result is checked by ``validate`` before anything is loaded: every value
against its field's type and rules, then the checks of fields together that the config class defines (its
``check()`` method: a trainer config's algorithm, tracker and run directory); a config without one that has an
``output_dir`` gets it created and checked writable at once. Every failure is a ``UserError`` (a ValueError)
naming the field; ``exit_on_user_error`` turns it into one line and exit 2.
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
    "diffusion LM": "masked-diffusion LM (block decoding, log-prob estimator knobs)",
    "optimisation": "optimisation",
    "logging": "logging, evaluation and checkpoints",
}

# the values of the fields many configs share
DTYPES = ("float32", "float16", "bfloat16")
OPTIMIZERS = ("adamw_torch", "adafactor", "adamw_8bit")  # unialign.trainers.schedule.make_optimizer
SCHEDULERS = ("constant", "linear", "cosine")  # unialign.trainers.schedule.lr_lambda
REPORT_TO = ("tensorboard", "wandb", "mlflow", "comet_ml", "all", "none")


def arg(default: Any, help: str, *, group: str | None = None, choices: Any = None,  # noqa: A002 - argparse's word
        min: float | None = None, max: float | None = None, gt: float | None = None, lt: float | None = None,  # noqa: A002
        hint: Callable[[Any, tuple], str | None] | None = None, check: Callable[[Any], Any] | None = None) -> Any:
    """A config field: its default, its ``--help`` line and its rules (module docstring), e.g.
    ``x: int = arg(8, "samples per prompt", group="algorithm", min=1)``. A rule left None is not set: a field
    declared again in a subclass keeps that rule of the field it overrides."""
    if group is not None and group not in GROUPS:
        raise ValueError(f"arg: group {group!r} is not one of {', '.join(GROUPS)}")
    rules = {"group": group, "choices": choices, "min": min, "max": max, "gt": gt, "lt": lt, "hint": hint,
             "check": check}
    return dataclasses.field(default=default, metadata={"help": help, **{k: v for k, v in rules.items() if v is not None}})


def default(value: Any) -> Any:
    """A field declared again for its default only: ``max_new_tokens: int = default(24)`` in a script's config keeps
    the help line and rules of the ``max_new_tokens`` it overrides (``field_rules`` reads them along the bases)."""
    return dataclasses.field(default=value)


# ------------------------------------------------------------------ field introspection
def field_rules(cls: type, f: dataclasses.Field) -> dict[str, Any]:
    """The rules of the field ``f`` of ``cls``: the metadata of each declaration of the field along ``cls``'s bases,
    the most derived winning key by key (a script declaring ``beta`` again with its own default keeps the bounds of
    the ``beta`` it overrides); ``choices`` read now, as a tuple."""
    rules: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        declared = klass.__dict__.get("__dataclass_fields__", {}).get(f.name)
        if declared is not None:
            rules.update(declared.metadata)
    rules.update(f.metadata)
    choices = rules.get("choices")
    if choices is not None:
        rules["choices"] = tuple(choices() if callable(choices) else choices)
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
        if "{presets}" in text:  # the preset field's help names the script's presets (``cls.PRESETS``)
            text = text.replace("{presets}", ", ".join(getattr(cls, "PRESETS", None) or {}) or "none")
        if rules.get("choices"):
            text += f" [one of: {', '.join(map(str, rules['choices']))}]"
        default = f.default if f.default is not dataclasses.MISSING else None
        if "(default:" not in text:
            text += f" (default: {default})"
        tuned = {k: v[f.name] for k, v in (getattr(cls, "MODEL_DEFAULTS", None) or {}).items()
                 if f.name in v and not Path(k).is_absolute()}  # by name, not also by folder
        if tuned:
            text += " (" + ", ".join(f"{v} with {k}" for k, v in tuned.items()) + ")"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
        if base is bool:
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        else:
            kwargs["metavar"] = {int: "INT", float: "FLOAT"}.get(base, "STR")
        section.add_argument(f"--{f.name}", **kwargs)
        for alias in (a for a, target in aliases.items() if target == f.name):
            section.add_argument(f"--{alias}", dest=f"{ALIAS_DEST}{alias}", default=argparse.SUPPRESS,
                                 metavar=kwargs["metavar"], help=f"the same as --{f.name} (another name for it)")
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
                raise UserError(f"{where}--{name} is another name for --{target}; both are given ({value} and "
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
    script's own ``check``. ``presets`` default to the class's own ``PRESETS`` (a ``ClassVar``). Unknown flags exit 2 (argparse); unknown YAML keys, values of the wrong type
    or outside their rules raise ``UserError`` naming the field."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _CREATED.clear()  # a user error from here on removes only the output folders this run's checks make
    presets = getattr(cls, "PRESETS", None) if presets is None else presets
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
    chosen = set(values)  # what a preset, YAML or a flag set (a knob the algorithm reset counts as set)
    _model_follows_the_data(cls, fields, values)
    model_defaults = _model_defaults(cls, fields, values)
    out = {}
    for name, value in values.items():
        try:
            out[name] = convert(value, *field_type(cls, fields[name]))
        except ValueError as err:
            where = f"{config_file}: " if name not in given and config_file else ""
            raise UserError(f"{where}--{name}: {err}") from None
    cfg = cls(**out)
    record_origin(cfg, chosen, model_defaults)
    validate(cfg)
    if check is not None:
        check(cfg)
    return cfg


ORIGIN = "_unialign_origin"  # instance attribute: which fields were set, and the model's own defaults applied


def record_origin(cfg: Any, chosen: set[str], model_defaults: tuple[str, dict[str, Any]] | None) -> None:
    """Remember on ``cfg`` which fields the user set (preset, YAML, flags or keywords) and which took the model's
    own defaults (``MODEL_DEFAULTS``): the run prints and records both (``origin``)."""
    model, values = model_defaults or (None, {})
    object.__setattr__(cfg, ORIGIN, {"set": frozenset(chosen), "model": model, "model_defaults": dict(values)})


def origin(cfg: Any) -> dict[str, Any]:
    """``record_origin``'s record of ``cfg`` (a config built directly: nothing known as set, no model defaults)."""
    return getattr(cfg, ORIGIN, None) or {"set": frozenset(), "model": None, "model_defaults": {}}


def model_defaults_key(table: dict[str, dict[str, Any]], model: Any) -> str | None:
    """The key of ``table`` (model name or folder -> field values) that ``model`` names: the same name, or a folder
    that resolves to the same place (the Python API is given the shipped models' folders)."""
    if not isinstance(model, str | os.PathLike):
        return None
    model = str(model)
    if model in table:
        return model
    try:
        here = Path(model).resolve()
    except (OSError, RuntimeError):
        return None
    return next((k for k in table if Path(k).is_absolute() and Path(k).resolve() == here), None)


def _model_follows_the_data(cls: type, fields: dict[str, dataclasses.Field], values: dict[str, Any]) -> None:
    """A data set only one model reads (``cls.DATASET_MODELS``: data set name -> model name, e.g. the shipped
    video questions and the shipped video VLM, whose tokenizer has their words) gives that model when nobody set
    ``model_name_or_path``; ``values`` is updated in place (the model then counts as a default, not as set)."""
    table = getattr(cls, "DATASET_MODELS", None)
    if not table or "model_name_or_path" in values or "dataset_name" not in fields:
        return
    model = table.get(values.get("dataset_name", fields["dataset_name"].default))
    if model is not None:
        values["model_name_or_path"] = model


def _model_defaults(cls: type, fields: dict[str, dataclasses.Field], values: dict[str, Any]
                    ) -> tuple[str, dict[str, Any]] | None:
    """A script's values tuned for one model (``cls.MODEL_DEFAULTS``: model name or folder -> field values, e.g. the
    embedded models' measured learning rate and schedule) fill the fields nobody set when ``model_name_or_path`` is
    that model; any other model keeps the class defaults (TRL's where TRL has the field). Returns (model, values
    applied); ``values`` is updated in place."""
    table = getattr(cls, "MODEL_DEFAULTS", None)
    if not table or "model_name_or_path" not in fields:
        return None
    key = model_defaults_key(table, values.get("model_name_or_path", fields["model_name_or_path"].default))
    if key is None:
        return None
    applied = {k: v for k, v in table[key].items() if k in fields and k not in values}
    values.update(applied)
    return key, applied


def _algorithm_knobs_follow_the_algorithm(cls: type, fields: dict[str, dataclasses.Field], values: dict[str, Any]) -> None:
    """A script's own defaults for algorithm knobs (``grpo_image.py``'s clip 1e-2 and beta 0.1, ...) are tuned for
    the script's default ``algorithm``. When a preset, YAML or the command line picks another algorithm, every knob
    nobody set falls back to None: the chosen algorithm's published value (``unialign.registry``), so
    ``--algorithm flow_grpo`` trains Flow-GRPO, not Flow-GRPO with the script's GRPO clip. A script may still
    measure its own values for another algorithm: ``cls.ALGORITHM_DEFAULTS[algorithm]`` (field -> value) fills
    those fields nobody set. The knobs are ``cls.ALGORITHM_KNOBS`` (an online config's: the fields of
    ``unialign.registry.AlgoOverrides``); ``values`` (what was set, by name) is updated in place."""
    algorithm = fields.get("algorithm")
    knobs = getattr(cls, "ALGORITHM_KNOBS", ())
    if not knobs or algorithm is None or values.get("algorithm", algorithm.default) == algorithm.default:
        return
    for knob in knobs:
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
    for key, value in loaded.items():
        if _size_over(value, YAML_MAX_ITEMS):
            raise UserError(f"--config {path}: {key!r}: its value expands to more than {YAML_MAX_ITEMS} items "
                            "(anchors and aliases repeating one another?); a field's value is a number, a string "
                            "or a short list")
    return loaded


YAML_MAX_ITEMS = 10_000  # a field's value as YAML gives it, counted with every alias expanded


def _size_over(value: Any, budget: int) -> bool:
    """Whether ``value`` (YAML data, where aliases make one object appear many times) has more than ``budget``
    items counted as if expanded, stopping as soon as it has: an alias bomb of 2^30 items costs ``budget`` steps
    (the string of such a value would take minutes and gigabytes)."""
    left, stack = budget, [value]
    while stack:
        item = stack.pop()
        left -= 1
        if left < 0:
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, (str, bytes)):
            left -= len(item) // 1000  # a long string counts by its thousands of characters
    return False


# ------------------------------------------------------------------ validation
_VALIDATED = "_unialign_validated"  # instance attribute: the field values ``validate`` last found good


def validate(cfg: Any) -> None:
    """Check every field of the dataclass ``cfg`` against its type and rules (see the module docstring), then the
    checks of fields together its class defines (``cfg.check()``: an online config's algorithm and group size, a
    trainer config's tracker and run directory); a config without ``check`` that has an ``output_dir`` gets it
    created and checked writable. Raises ``UserError`` naming the first bad field. The checks run once per config:
    ``parse_config`` validates what it builds, and the trainers' call for the same config, unchanged since,
    returns at once (one changed field, and everything is checked again)."""
    cls = type(cfg)
    if getattr(cfg, _VALIDATED, None) == _values(cfg):
        return
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
    check = getattr(cfg, "check", None)
    if callable(check):
        check()
    elif getattr(cfg, "output_dir", None):
        check_output_dir(cfg.output_dir)
    object.__setattr__(cfg, _VALIDATED, _values(cfg))


def _values(cfg: Any) -> list[Any]:
    return [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]


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
    if rules.get("check"):
        try:
            rules["check"](value)
        except ValueError as err:
            raise UserError(f"--{name}: {err}") from None
    choices = rules.get("choices")
    if choices and value not in choices:
        from unialign.errors import did_you_mean

        reason = rules["hint"](value, choices) if rules.get("hint") else None
        raise UserError(f"--{name}: {reason}" if reason else f"--{name}: {value!r} is not one of "
                        f"{', '.join(map(str, choices))}{did_you_mean(value, choices)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{name}: must be a finite number, got {value}")
        for key, ok, words in (("min", lambda b: value >= b, ">="), ("max", lambda b: value <= b, "<="),
                               ("gt", lambda b: value > b, ">"), ("lt", lambda b: value < b, "<")):
            if key in rules and not ok(rules[key]):
                raise UserError(f"--{name}: must be {words} {rules[key]}, got {value}")


def check_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and parents) if needed and prove it is a writable directory by writing a file in it.
    Raises ``UserError`` when it is an existing file or cannot be created or written."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_dir: {str(out)!r} exists and is not a directory")
    missing = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        raise UserError(f"--output_dir: {str(out)!r} is not a writable directory ({err.strerror or err})") from None
    if missing:
        _CREATED.append(missing)  # removed again if the run stops on a user error before writing anything
    return out


_CREATED: list[list[Path]] = []  # the folders check_output_dir made, innermost first, per call


def remove_unused_output_dirs() -> None:
    """Remove the folders ``check_output_dir`` created that are still empty (a run refused after its config was
    checked leaves no empty output directory behind); anything written in them keeps them."""
    while _CREATED:
        for folder in _CREATED.pop():
            try:
                folder.rmdir()  # only an empty folder goes
            except OSError:
                break


@contextlib.contextmanager
def exit_on_user_error():
    """Turn the errors a user can fix (missing hub access, bad data, bad config) into a one-line
    message and exit status 2, instead of a stack trace from deep inside a library."""
    from unialign.files import FULL_ERRNOS
    from unialign.hub import HubUnavailableError

    try:
        yield
    except (HubUnavailableError, FileNotFoundError, ValueError) as err:
        remove_unused_output_dirs()
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as err:  # a full disk in a write no writer of ours wraps: still one line
        if err.errno not in FULL_ERRNOS:
            raise
        where = f" while writing {err.filename}" if err.filename else ""
        print(f"error: {FULL_ERRNOS[err.errno]}{where}: free some space, then --resume_from_checkpoint latest",
              file=sys.stderr)
        raise SystemExit(2) from None
