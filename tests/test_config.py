"""Config parsing: defaults < preset < YAML < flags; unknown keys and presets are errors; values checked by
type and by their field's rules before anything loads; --help of every script grouped, with help and choices."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import pytest

from unialign.config import (
    DTYPES,
    GROUPS,
    UserError,
    arg,
    build_parser,
    check_output_dir,
    field_rules,
    parse_config,
)


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


@dataclass
class Ruled:
    output_dir: str
    config: str | None = None
    max_steps: int = field(default=10, metadata={"help": "steps", "min": 1})  # a plain field's metadata works too
    temperature: float = arg(1.0, "sampling temperature", gt=0.0)
    torch_dtype: str = arg("float32", "dtype", choices=DTYPES)
    mode: str = arg("a", "mode", choices=("a", "b"))
    limit: int | None = None
    flag: bool = False


def test_validate_types_and_the_rules_written_beside_each_field(tmp_path):
    out = ["--output_dir", str(tmp_path / "out")]
    cfg = parse_config(Ruled, out + ["--limit", "none", "--flag", "--temperature", "0.5"])
    assert (cfg.limit, cfg.flag, cfg.temperature) == (None, True, 0.5) and (tmp_path / "out").is_dir()
    for argv, message in ((["--max_steps", "0"], "--max_steps: must be >= 1, got 0"),
                          (["--max_steps", "ten"], "--max_steps: expected an integer, got 'ten'"),
                          (["--temperature", "0"], "--temperature: must be > 0.0, got 0.0"),
                          (["--temperature", "nan"], "--temperature: must be a finite number"),
                          (["--torch_dtype", "nosuch"], "--torch_dtype: 'nosuch' is not one of float32, float16, bfloat16"),
                          (["--mode", "c"], "--mode: 'c' is not one of a, b"),
                          (["--flag", "maybe"], "--flag: expected true or false")):
        with pytest.raises(UserError, match=re.escape(message)):
            parse_config(Ruled, out + argv)


def test_rules_come_from_the_field_and_the_field_it_overrides_never_from_its_name(tmp_path):
    """A field's rules are the ones written beside it and beside the field it overrides (a script re-declaring
    ``beta`` with its own default keeps its bounds); a field of another class that happens to be called ``beta``
    or ``temperature`` gets none."""
    from unialign.trainers import OnlineConfig

    @dataclass
    class Unrelated:
        beta: float = arg(-1.0, "not a KL coefficient")
        temperature: float = -2.0

    cfg = parse_config(Unrelated, [])
    assert (cfg.beta, cfg.temperature) == (-1.0, -2.0)
    assert field_rules(Unrelated, dataclasses.fields(Unrelated)[0]) == {"help": "not a KL coefficient"}

    @dataclass
    class Script(OnlineConfig):
        beta: float | None = arg(0.1, "KL coefficient of this script")
        epsilon: float | None = arg(1e-2, "clip", gt=1e-3)  # a rule given again wins

    rules = {f.name: field_rules(Script, f) for f in dataclasses.fields(Script)}
    assert rules["beta"] == {"help": "KL coefficient of this script", "group": "algorithm", "min": 0.0}
    assert rules["epsilon"]["gt"] == 1e-3 and rules["epsilon"]["group"] == "algorithm"
    with pytest.raises(UserError, match=re.escape("--beta: must be >= 0.0, got -1.0")):
        parse_config(Script, ["--beta", "-1", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="group 'algo' is not one of"):
        arg(1, "x", group="algo")


def test_validate_checks_a_config_once_until_a_field_changes(tmp_path, monkeypatch):
    """parse_config validates; the trainers' validate of the same, unchanged config does nothing again."""
    from unialign import config as config_module
    from unialign.trainers import OnlineConfig

    cfg = parse_config(OnlineConfig, ["--output_dir", str(tmp_path)])
    calls = []
    real = config_module._check_rules
    monkeypatch.setattr(config_module, "_check_rules", lambda *a: calls.append(a[0]) or real(*a))
    config_module.validate(cfg)
    assert calls == []
    cfg.prompts_per_step = 0
    with pytest.raises(UserError, match="--prompts_per_step: must be >= 1, got 0"):
        config_module.validate(cfg)
    cfg.prompts_per_step = 4
    config_module.validate(cfg)
    assert "prompts_per_step" in calls


def test_yaml_values_of_the_wrong_type_name_file_and_field(tmp_path):
    out = ["--output_dir", str(tmp_path / "out")]
    good = tmp_path / "good.yaml"
    good.write_text("temperature: 1e-3\nmax_steps: 4\nflag: true\n")  # PyYAML reads 1e-3 as a string
    cfg = parse_config(Ruled, out + ["--config", str(good)])
    assert (cfg.temperature, cfg.max_steps, cfg.flag) == (1e-3, 4, True)
    for text, message in (("max_steps: ten\n", "bad.yaml: --max_steps: expected an integer, got 'ten'"),
                          ("max_steps: 2.5\n", "bad.yaml: --max_steps: expected an integer, got 2.5"),
                          ("mode: [a]\n", "bad.yaml: --mode: expected a string"),
                          ("flag: 3\n", "bad.yaml: --flag: expected true or false"),
                          ("- a\n- b\n", "expected a mapping"),
                          ("max_steps: [\n", "not valid YAML")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(UserError, match=re.escape(message)):
            parse_config(Ruled, out + ["--config", str(bad)])


def test_output_dir_must_be_a_writable_directory(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        check_output_dir(a_file)
    with pytest.raises(UserError, match="is not a writable directory"):
        check_output_dir(a_file / "sub")
    assert check_output_dir(tmp_path / "new" / "dir").is_dir()


SCRIPTS = ("grpo_math", "dpo_text", "train_reward_model", "ppo_rlhf", "dpo_sdxl", "grpo_image", "ddpo_aesthetic", "sft",
           "grpo_video")


def script_config(name: str):
    from tests.test_scripts import load_script

    module = load_script(name)
    cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
               and v.__module__ == module.__name__)
    return module, cls


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_has_help_a_group_and_its_choices(name, capsys):
    module, cls = script_config(name)
    for f in dataclasses.fields(cls):
        rules = field_rules(cls, f)
        assert rules.get("help"), f"{name}: --{f.name} has no help"
        assert rules.get("group") in GROUPS, f"{name}: --{f.name} has no --help group"
    with pytest.raises(SystemExit) as exit_info:
        build_parser(cls).parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    groups = {field_rules(cls, f).get("group") for f in dataclasses.fields(cls)}
    assert all(title + ":" in text for title in ("model", "data", "algorithm", "optimisation") if title in groups)
    assert {"model", "data", "optimisation"} <= groups  # sft.py has no algorithm knob; every other script has
    assert "[one of: constant, linear, cosine]" in text and "[one of: adamw_torch, adafactor, adamw_8bit]" in text
    assert "--report_to STR" in text and "none]" in text
    if hasattr(cls, "algo_spec"):
        assert "grpo, dapo" in text and "--loss_type" in text and "token_mean" in text
    if "loss_type" in {f.name for f in dataclasses.fields(cls)} and not hasattr(cls, "algo_spec"):
        assert "[one of: sigmoid, ipo, hinge, robust]" in text


@pytest.mark.parametrize("argv, message", [
    (["--loss_type", "nosuch"], "--loss_type: 'nosuch' is not one of"),
    (["--algorithm", "nosuch"], "--algorithm: 'nosuch' is not one of grpo"),
    (["--prompts_per_step", "0"], "--prompts_per_step: must be >= 1, got 0"),
    (["--num_generations", "1"], "--num_generations: must be >= 2 for grpo"),
    (["--report_to", "nosuch"], "--report_to: 'nosuch' is not one of"),
    (["--optim", "sgd"], "--optim: 'sgd' is not one of adamw_torch"),
    (["--learning_rate", "-1"], "--learning_rate: must be >= 0.0"),
    (["--eval_fraction", "1.5"], "--eval_fraction: must be < 1.0"),
    (["--overlong_rows", "truncate"], "--overlong_rows: 'truncate' is not one of error, drop"),
    (["--algorithm", "grop"], "(did you mean 'grpo'?)"),
    (["--loss_type", "token_men"], "(did you mean 'token_mean'?)"),
])
def test_script_settings_refused_at_parse_time(argv, message, tmp_path):
    _, cls = script_config("grpo_math")
    with pytest.raises(UserError, match=re.escape(message)):
        parse_config(cls, argv + ["--output_dir", str(tmp_path)])


def test_configs_built_in_python_are_validated_by_the_trainers(tmp_path):
    from unialign.config import UserError
    from unialign.trainers import OnlineConfig, OnlineTrainer
    from unialign.trainers.preference import PreferenceConfig, PreferenceTrainer

    with pytest.raises(UserError, match="--prompts_per_step: must be >= 1, got 0"):
        OnlineTrainer(None, [], [{"prompt": "a"}], OnlineConfig(prompts_per_step=0, output_dir=str(tmp_path)))
    with pytest.raises(UserError, match="--max_steps: expected an integer"):
        PreferenceTrainer(None, [{"prompt": "a"}], PreferenceConfig(max_steps="two", output_dir=str(tmp_path)))


def test_every_algorithm_knob_is_a_flag_declared_once_in_the_registry(tmp_path):
    """OnlineConfig inherits AlgoOverrides: one optional field per AlgoSpec knob, the same names in the same order,
    each of its knob's type or None, with its help and rules, so every knob, the estimator included, is settable
    from the command line and checked there."""
    import typing

    from unialign.registry import FACTS, KNOBS, AlgoOverrides, AlgoSpec
    from unialign.trainers import OnlineConfig

    knobs = [f.name for f in dataclasses.fields(AlgoSpec) if f.name not in FACTS]
    assert knobs == [f.name for f in dataclasses.fields(AlgoOverrides)] == list(KNOBS)
    spec_types, override_types = typing.get_type_hints(AlgoSpec), typing.get_type_hints(AlgoOverrides)
    for k in knobs:
        assert override_types[k] == spec_types[k] | None, k
    config_fields = {f.name: f for f in dataclasses.fields(OnlineConfig)}
    assert all(k in config_fields and config_fields[k].default is None for k in knobs)
    assert all(field_rules(OnlineConfig, config_fields[k])["group"] == "algorithm" for k in knobs)
    out = ["--output_dir", str(tmp_path)]
    cfg = parse_config(OnlineConfig, ["--algorithm", "ddpo", "--advantage", "group", "--advantage_clip", "3",
                                      "--whiten_advantages", "true", "--stat_buffer_size", "8"] + out)
    spec = cfg.algo_spec()
    assert (spec.advantage, spec.advantage_clip, spec.whiten_advantages, spec.stat_buffer_size) == ("group", 3.0, True, 8)
    assert spec.epsilon == 1e-4  # untouched knobs keep the preset's value
    for argv, message in [(["--epsilon", "0"], "--epsilon: must be > 0"), (["--advantage", "nosuch"], "--advantage"),
                          (["--gamma", "1.5"], "--gamma: must be <= 1")]:
        with pytest.raises(UserError, match=message):
            parse_config(OnlineConfig, argv + out)


def test_group_size_check_reads_the_estimators_registry(tmp_path):
    """num_generations >= 2 wherever the estimator's registry entry says it uses groups (win_rate too), and
    nowhere else."""
    from unialign.algos.advantage_estimators import ADVANTAGE_ESTIMATORS
    from unialign.trainers import OnlineConfig

    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        argv = ["--algorithm", "grpo", "--advantage", name, "--num_generations", "1", "--output_dir", str(tmp_path)]
        if estimator.uses_groups:
            with pytest.raises(UserError, match=re.escape("--num_generations: must be >= 2 for grpo")):
                parse_config(OnlineConfig, argv)
        else:
            assert parse_config(OnlineConfig, argv).algo_spec().advantage == name


def test_script_knob_defaults_follow_only_the_scripts_algorithm():
    """A script tunes knobs for its default algorithm (grpo_image: clip 1e-2, beta 0.1); picking another algorithm
    gives that algorithm's published knobs unless a flag / preset / YAML sets them."""
    from dataclasses import dataclass, field

    from unialign.trainers import OnlineConfig

    @dataclass
    class ScriptConfig(OnlineConfig):
        preset: str | None = field(default=None, metadata={"help": "x"})
        algorithm: str = field(default="grpo", metadata={"help": "x"})
        epsilon: float | None = field(default=1e-2, metadata={"help": "x"})
        beta: float | None = field(default=0.1, metadata={"help": "x"})

    default = parse_config(ScriptConfig, []).algo_spec()
    assert (default.epsilon, default.beta) == (1e-2, 0.1)
    ddpo = parse_config(ScriptConfig, ["--algorithm", "ddpo"]).algo_spec()
    assert (ddpo.epsilon, ddpo.beta, ddpo.advantage_clip) == (1e-4, 0.0, 5.0)
    flow = parse_config(ScriptConfig, ["--algorithm", "flow_grpo", "--beta", "0.5"]).algo_spec()
    assert (flow.epsilon, flow.beta) == (1e-4, 0.5)
    preset = parse_config(ScriptConfig, ["--preset", "p"], presets={"p": {"algorithm": "dapo", "epsilon": 0.3}}).algo_spec()
    assert (preset.epsilon, preset.epsilon_high, preset.beta) == (0.3, 0.28, 0.0)


def test_a_tracker_that_is_not_installed_is_refused_not_skipped(tmp_path, monkeypatch):
    """accelerate drops an unavailable tracker silently (a run with no logs at all); here it is one line."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    _, cls = script_config("grpo_math")
    with pytest.raises(UserError, match=re.escape("--report_to wandb: the wandb package is not installed")):
        parse_config(cls, ["--report_to", "wandb", "--output_dir", str(tmp_path)])
    parse_config(cls, ["--report_to", "none", "--output_dir", str(tmp_path / "b")])


def test_did_you_mean_for_algorithms_and_rewards():
    from unialign.registry import get_algorithm
    from unialign.rewards import get_reward

    with pytest.raises(ValueError, match=re.escape("(did you mean 'dapo'?)")):
        get_algorithm("dapoo")
    with pytest.raises(ValueError, match=re.escape("unknown reward 'math_acuracy' (did you mean 'math_accuracy'?)")):
        get_reward("math_acuracy")
