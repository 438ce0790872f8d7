"""Config parsing: defaults < preset < YAML < flags; unknown keys and presets are errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from unialign.config import UserError, parse_config


@dataclass
class Cfg:
    preset: str | None = None
    config: str | None = None
    learning_rate: float = 1e-3
    max_steps: int = 10
    name: str = "default"


PRESETS = {"big": {"learning_rate": 1e-5, "max_steps": 500, "name": "big"}}


def test_precedence_defaults_preset_yaml_flags(tmp_path):
    assert parse_config(Cfg, []).learning_rate == 1e-3
    cfg = parse_config(Cfg, ["--preset", "big"], PRESETS)
    assert (cfg.learning_rate, cfg.max_steps, cfg.name) == (1e-5, 500, "big")
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("max_steps: 7\nname: from-yaml\n")
    cfg = parse_config(Cfg, ["--preset", "big", "--config", str(yaml_file), "--name", "flag"], PRESETS)
    assert (cfg.learning_rate, cfg.max_steps, cfg.name) == (1e-5, 7, "flag")


def test_unknown_yaml_key_and_preset_are_errors(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("max_stepz: 7\n")
    with pytest.raises(UserError, match="unknown config keys"):
        parse_config(Cfg, ["--config", str(yaml_file)])
    with pytest.raises(UserError, match="unknown preset 'huge'"):
        parse_config(Cfg, ["--preset", "huge"], PRESETS)
