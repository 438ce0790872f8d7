"""``--config file.yaml``: a key given twice is a one-line error naming the key, its lines and the file (PyYAML's
``safe_load`` silently keeps the last); the file is still safe-loaded."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from unialign.config import UserError, arg, parse_config


@dataclass
class Cfg:
    config: str | None = arg(None, "YAML file", group="config")
    learning_rate: float = arg(1e-3, "lr", group="optimisation")
    max_steps: int = arg(10, "steps", group="optimisation")
    dataset_name: str = arg("x", "data", group="data")


def test_duplicate_keys_are_an_error_naming_key_lines_and_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("learning_rate: 1e-4\nmax_steps: 5\nlearning_rate: 3e-4\n")
    with pytest.raises(UserError, match=r"--config .*run.yaml: key 'learning_rate' is given twice \(lines 1 and 3\)") \
            as err:
        parse_config(Cfg, ["--config", str(f)])
    assert "\n" not in str(err.value)
    f.write_text("{max_steps: 5, max_steps: 6}\n")  # a flow mapping, both on one line
    with pytest.raises(UserError, match=r"key 'max_steps' is given twice \(lines 1 and 1\)"):
        parse_config(Cfg, ["--config", str(f)])
    f.write_text("dataset_name: a\nnested:\n  k: 1\n  k: 2\n")  # in a nested mapping too, before unknown keys
    with pytest.raises(UserError, match=r"key 'k' is given twice \(lines 3 and 4\)"):
        parse_config(Cfg, ["--config", str(f)])


def test_yaml_still_loads_safely_and_merge_keys_may_override(tmp_path):
    f = tmp_path / "ok.yaml"
    f.write_text("learning_rate: 1e-4\nmax_steps: 5\n")
    cfg = parse_config(Cfg, ["--config", str(f), "--max_steps", "7"])
    assert cfg.learning_rate == 1e-4 and cfg.max_steps == 7
    f.write_text("base: &b {max_steps: 3}\n")  # anchors fine; an unknown key is still named
    with pytest.raises(UserError, match=r"unknown config keys \['base'\]"):
        parse_config(Cfg, ["--config", str(f)])
    f.write_text("<<: {max_steps: 3, learning_rate: 0.5}\nmax_steps: 4\n")  # a merge key's values may be overridden
    cfg = parse_config(Cfg, ["--config", str(f)])
    assert cfg.max_steps == 4 and cfg.learning_rate == 0.5
    f.write_text("learning_rate: !!python/object/apply:os.system ['echo hi']\n")  # never constructed
    with pytest.raises(UserError, match=r"not valid YAML"):
        parse_config(Cfg, ["--config", str(f)])


BOMB = """import sys
from dataclasses import dataclass
from unialign.config import arg, parse_config
@dataclass
class Cfg:
    config: str | None = arg(None, "YAML file", group="config")
    dataset_name: str = arg("x", "data", group="data")
parse_config(Cfg, ["--config", sys.argv[1]])
"""


@pytest.mark.slow
def test_an_alias_bomb_in_one_fields_value_is_refused_at_once(tmp_path):
    """Nine levels of nine aliases (9^10 strings once expanded) inside one value: refused in a moment, naming the
    field (it ran past 120 s and 9 GB before), while anchors of normal size keep working."""
    import subprocess
    import sys

    levels = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    f = tmp_path / "bomb.yaml"
    f.write_text("dataset_name: [" + ", ".join(levels) + "]\n")
    proc = subprocess.run([sys.executable, "-c", BOMB, str(f)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "'dataset_name': its value expands to more than 10000 items" in proc.stderr
    f.write_text("<<: &base {max_steps: 3}\nlearning_rate: 0.5\n")
    assert parse_config(Cfg, ["--config", str(f)]).max_steps == 3
