"""Defaults that fit the model: TRL's for a user's model (checked against the installed TRL), the shipped models'
measured values for those models only, and every remaining difference from TRL printed at start and recorded."""

from __future__ import annotations

import pytest

from tests.test_scripts import load_script
from unialign.config import origin, parse_config
from unialign.trl_compat import TRL_DEFAULTS, trl_departures


def _trl_config(name: str):
    trl = pytest.importorskip("trl")
    return getattr(trl, name)(output_dir="/tmp/unialign-trl-defaults", bf16=False, use_cpu=True)


@pytest.mark.parametrize("name", sorted(TRL_DEFAULTS))
def test_the_table_of_trl_defaults_is_the_installed_trls(name):
    cfg = _trl_config(name)
    spelling = {"loss_type": {"dapo": "token_mean"}}  # TRL's names in unialign's spelling
    for field, value in TRL_DEFAULTS[name].items():
        theirs = getattr(cfg, field)
        theirs = theirs[0] if isinstance(theirs, list) and len(theirs) == 1 else theirs  # DPO's loss_type list
        theirs = getattr(theirs, "value", theirs)  # transformers' SchedulerType enum
        assert spelling.get(field, {}).get(theirs, theirs) == value, (name, field)


def test_the_python_api_configs_start_from_trls_defaults():
    from unialign import DPOConfig, GRPOConfig

    grpo, dpo = GRPOConfig(output_dir="/tmp/x-grpo"), DPOConfig(output_dir="/tmp/x-dpo")
    assert (grpo.learning_rate, grpo.lr_scheduler_type, grpo.beta, grpo.seed, grpo.max_completion_length) == \
        (1e-6, "linear", 0.0, 42, 512)
    assert (dpo.learning_rate, dpo.lr_scheduler_type, dpo.seed) == (1e-6, "linear", 42)
    # what remains different is one documented line each; what the user sets is theirs
    assert [d["field"] for d in trl_departures(grpo, origin(grpo))] == ["loss_type"]
    dapo = GRPOConfig(output_dir="/tmp/x-grpo", loss_type="dapo")
    assert trl_departures(dapo, origin(dapo)) == []
    assert trl_departures(dpo, origin(dpo)) == []


def _cfg(script: str, argv: list[str], tmp_path):
    module = load_script(script)
    cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
               and v.__module__ == module.__name__)
    return parse_config(cls, argv + ["--output_dir", str(tmp_path / "out")])


@pytest.mark.parametrize("script,tuned", [
    ("grpo_math", dict(learning_rate=3e-4, lr_scheduler_type="cosine", warmup_steps=5, max_new_tokens=32)),
    ("dpo_text", dict(learning_rate=2e-4, lr_scheduler_type="constant", batch_size=32)),
    ("train_reward_model", dict(learning_rate=1e-3, lr_scheduler_type="constant")),
    ("ppo_rlhf", dict(learning_rate=1e-4, beta=0.5, max_new_tokens=24)),
    ("grpo_vision", dict(learning_rate=1e-3, lr_scheduler_type="cosine", max_new_tokens=8)),
])
def test_the_shipped_models_defaults_apply_to_them_only(tmp_path, script, tuned):
    shipped = _cfg(script, [], tmp_path)
    assert {k: getattr(shipped, k) for k in tuned} == tuned and origin(shipped)["model_defaults"]
    mine = _cfg(script, ["--model_name_or_path", str(tmp_path / "my_model")], tmp_path)
    assert origin(mine)["model_defaults"] == {} and all(getattr(mine, k) != v for k, v in tuned.items())
    assert mine.num_threads is None  # the loop picks one thread for a small model on CPU, torch's otherwise
    trl = getattr(type(mine), "TRL_CONFIG", None)
    if trl:  # a user's model: TRL's learning rate and schedule
        assert (mine.learning_rate, mine.lr_scheduler_type) == (TRL_DEFAULTS[trl]["learning_rate"], "linear")
    # a flag wins over the model's default, and is not reported as a departure
    flagged = _cfg(script, ["--learning_rate", "5e-3"], tmp_path)
    assert flagged.learning_rate == 5e-3 and "learning_rate" not in origin(flagged)["model_defaults"]
    assert all(d["field"] != "learning_rate" for d in trl_departures(flagged, origin(flagged)))


def test_a_users_model_gets_trls_values_and_the_departures_are_printed(tmp_path, capsys):
    from accelerate import Accelerator

    from unialign.trainers.outputs import announce_defaults, defaults_record

    mine = _cfg("grpo_math", ["--model_name_or_path", str(tmp_path / "my_qwen")], tmp_path)
    assert (mine.learning_rate, mine.lr_scheduler_type, mine.warmup_steps, mine.max_new_tokens) == \
        (1e-6, "linear", 0, 512)
    announce_defaults(Accelerator(cpu=True), mine)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines and all(line.startswith("default differs from TRL's GRPOConfig: ") for line in lines)
    assert {line.split(": ")[1].split("=")[0] for line in lines} == {"seed", "loss_type"}
    shipped = _cfg("grpo_math", [], tmp_path)
    announce_defaults(Accelerator(cpu=True), shipped)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("defaults for the model 'embedded'") and "learning_rate=0.0003" in first
    record = defaults_record(shipped)
    assert record["model_defaults"]["values"]["lr_scheduler_type"] == "cosine"
    assert {d["field"] for d in record["trl_departures"]} >= {"learning_rate", "lr_scheduler_type", "warmup_steps"}
