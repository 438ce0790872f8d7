"""Typed configs from the command line: one dataclass per script, optional YAML file, presets.

``parse_config(Cls)`` reads ``--config file.yaml`` (keys are field names) and then command-line
flags, which win. A script's ``presets`` dict maps a preset name to field overrides applied
before the YAML and flags (so flags can still change a preset's value).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, TypeVar

T = TypeVar("T")


def parse_config(cls: type[T], argv: list[str] | None = None, presets: dict[str, dict[str, Any]] | None = None) -> T:
    """Build ``cls`` from defaults < preset < YAML < command-line flags; unknown keys are errors."""
    import yaml
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(cls)
    (cli,) = parser.parse_args_into_dataclasses(args=argv)
    explicit = _explicit_fields(argv)
    values: dict[str, Any] = {}
    preset = getattr(cli, "preset", None)
    if preset:
        if not presets or preset not in presets:
            raise SystemExit(f"--preset: unknown preset {preset!r}; choose one of {sorted(presets or {})}")
        values.update(presets[preset])
    config_file = getattr(cli, "config", None)
    if config_file:
        with open(config_file) as f:
            loaded = yaml.safe_load(f) or {}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(loaded) - names)
        if unknown:
            raise SystemExit(f"{config_file}: unknown config keys {unknown}")
        values.update(loaded)
    values.update({name: getattr(cli, name) for name in explicit})
    return dataclasses.replace(cli, **values)


def _explicit_fields(argv: list[str]) -> set[str]:
    out = set()
    for arg in argv:
        if arg.startswith("--"):
            out.add(arg[2:].split("=", 1)[0].replace("-", "_"))
    return out


@contextlib.contextmanager
def exit_on_user_error():
    """Turn the errors a user can fix (missing hub access, bad data, bad config) into a one-paragraph
    message and exit status 2, instead of a stack trace from deep inside a library."""
    from unialign.hub import HubUnavailableError

    try:
        yield
    except (HubUnavailableError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
