"""The configs' outside, frozen: every script's ``--help`` (flags, help lines, groups, choices, defaults), every
field's rules (bounds, choices, group), and the resolved config of its default, of each preset and of each
``--algorithm`` choice (with ``algo_spec()`` where there is one); the library's configs' fields and defaults too.
A change to any of them fails here: ``tests/data/config_snapshot.json`` holds the values last accepted. To accept a
deliberate change, regenerate it:

    python -m tests.test_config_snapshot        # rewrites tests/data/config_snapshot.json

The scripts' docstrings (the --help description, prose) are left out: ``<docstring>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

SNAPSHOT = Path(__file__).parent / "data" / "config_snapshot.json"
SCRIPTS = ("grpo_math", "dpo_text", "train_reward_model", "ppo_rlhf", "dpo_sdxl", "grpo_image", "ddpo_aesthetic", "sft",
           "grpo_video")
WIDTH = "100"  # COLUMNS: argparse wraps --help to the terminal's width
RULE_KEYS = ("help", "group", "choices", "min", "max", "gt", "lt", "check")  # the rules unialign.config documents


def _plain(value: Any) -> Any:
    """JSON's view of a value: tuples as lists, anything else not JSON as its repr."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value):  # a field's check: its name (a repr would hold an address)
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def _fields(cls: type) -> dict[str, Any]:
    """Every field of ``cls``: its default, (base type, optional) and its rules (help, group, choices, bounds)."""
    from unialign.config import field_rules, field_type

    out = {}
    for f in dataclasses.fields(cls):
        base, optional = field_type(cls, f)
        default = f.default if f.default is not dataclasses.MISSING else "<no default>"
        out[f.name] = {"default": _plain(default), "type": [getattr(base, "__name__", None), optional],
                       "rules": _plain({k: v for k, v in field_rules(cls, f).items() if k in RULE_KEYS})}
    return out


def _help(cls: type, name: str) -> str:
    from unialign.config import build_parser

    parser = build_parser(cls, prog=f"{name}.py")
    parser.description = "<docstring>" if parser.description else None
    return parser.format_help()


REPO = str(Path(__file__).resolve().parents[1])  # a clone's own path (shipped prompt files) is no setting


def _resolved(cfg: Any, root: str) -> dict[str, Any]:
    values = json.loads(json.dumps(_plain(dataclasses.asdict(cfg))).replace(root, "<tmp>").replace(REPO, "<repo>"))
    if hasattr(cfg, "algo_spec"):  # the algorithm as resolved: its name and every knob (not its facts: modalities)
        from unialign.registry import KNOBS

        spec = cfg.algo_spec()
        values["algo_spec()"] = _plain({"name": spec.name, **{k: getattr(spec, k) for k in KNOBS}})
    return values


@contextlib.contextmanager
def _environment():
    """A fixed terminal width and a fresh working directory (relative output_dirs land there)."""
    saved_cwd, saved_columns = os.getcwd(), os.environ.get("COLUMNS")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["COLUMNS"] = WIDTH
        os.chdir(tmp)
        try:
            yield os.path.realpath(tmp)
        finally:
            os.chdir(saved_cwd)
            if saved_columns is None:
                os.environ.pop("COLUMNS", None)
            else:
                os.environ["COLUMNS"] = saved_columns


def snapshot() -> dict[str, Any]:
    """The values this test freezes (see the module docstring)."""
    from tests.test_config import script_config
    from unialign.config import UserError, field_rules, parse_config
    from unialign.recipes.text import TextDataArgs
    from unialign.trainers.train_config import TrainConfig

    out: dict[str, Any] = {"scripts": {}, "library": {}}
    with _environment() as root:
        for name in SCRIPTS:
            module, cls = script_config(name)
            runs = {"default": [], **{f"--preset {p}": ["--preset", p] for p in module.PRESETS}}
            algorithm = next((f for f in dataclasses.fields(cls) if f.name == "algorithm"), None)
            if algorithm is not None:
                for choice in field_rules(cls, algorithm).get("choices") or ():
                    runs[f"--algorithm {choice}"] = ["--algorithm", choice]
            resolved = {}
            for label, argv in runs.items():
                try:
                    values = _resolved(parse_config(cls, argv, presets=module.PRESETS), root)
                except UserError as err:  # refused at parse time: the message is the behaviour
                    values = {"error": str(err)}
                if label != "default":  # what differs from the default run (the default is given whole)
                    values = {k: v for k, v in values.items() if resolved["default"].get(k, KeyError) != v}
                resolved[label] = values
            out["scripts"][name] = {"help": _help(cls, name).replace(root, "<tmp>"),
                                    "fields": _fields(cls), "resolved": resolved}
        from unialign.recipes.image import ImageRLConfig
        from unialign.trainers import OnlineConfig
        from unialign.trainers.preference import PreferenceConfig
        from unialign.trl import DPOConfig, GRPOConfig

        for cls in (TrainConfig, OnlineConfig, PreferenceConfig, TextDataArgs, ImageRLConfig, GRPOConfig, DPOConfig):
            out["library"][cls.__name__] = {"fields": _fields(cls), "default": _resolved(cls(), root)}
    return out


@pytest.mark.slow
def test_help_rules_and_resolved_configs_are_unchanged():
    expected = json.loads(SNAPSHOT.read_text())
    actual = json.loads(json.dumps(snapshot()))
    for name in expected["scripts"]:
        want, got = expected["scripts"][name], actual["scripts"][name]
        assert got["help"] == want["help"], f"{name}: --help changed"
        for field_name in want["fields"].keys() | got["fields"].keys():
            assert got["fields"].get(field_name) == want["fields"].get(field_name), f"{name}: field {field_name}"
        for label in want["resolved"].keys() | got["resolved"].keys():
            assert got["resolved"].get(label) == want["resolved"].get(label), f"{name} {label}: resolved config"
    for name in expected["library"]:
        want, got = expected["library"][name], actual["library"][name]
        for field_name in want["fields"].keys() | got["fields"].keys():
            assert got["fields"].get(field_name) == want["fields"].get(field_name), f"{name}: field {field_name}"
        assert got["default"] == want["default"], f"{name}(): defaults"
    assert actual == expected


if __name__ == "__main__":
    SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
    SNAPSHOT.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
