"""The scripts' argument groups whose defaults are the shipped demo worlds (unialign.embedded.args)."""

from dataclasses import dataclass

import pytest

from unialign.config import parse_config
from unialign.embedded import ARITH_LM_DIR, NAME, model_path
from unialign.embedded.args import EmbeddedPairArgs, EmbeddedTaskArgs
from unialign.errors import UserError
from unialign.recipes.args import RunArgs, TextModelArgs


@dataclass
class PairConfig(EmbeddedPairArgs, RunArgs, TextModelArgs):
    pass


def test_the_defaults_are_the_arithmetic_world_and_override_the_core_groups():
    cfg = parse_config(PairConfig, [])
    assert (cfg.model_name_or_path, cfg.dataset_name, cfg.max_completion_length) == (NAME, NAME, 1024)
    assert model_path(cfg.model_name_or_path) == str(ARITH_LM_DIR) and (ARITH_LM_DIR / "config.json").is_file()
    assert parse_config(PairConfig, ["--model_name_or_path", "Qwen/Qwen2.5-0.5B"]).model_name_or_path \
        == "Qwen/Qwen2.5-0.5B"
    assert not hasattr(parse_config(type("C", (EmbeddedTaskArgs,), {}), []), "max_completion_length")


def test_a_pair_length_below_one_is_refused_naming_the_field():
    with pytest.raises(UserError, match="max_completion_length"):
        parse_config(PairConfig, ["--max_completion_length", "0"])


@pytest.mark.parametrize("script, argv, steps, lr", [
    ("grpo_math", [], 200, 3e-4),                                            # the arithmetic model (docs/text.md)
    ("grpo_math", ["--model_name_or_path", "embedded-mdlm"], 100, 3e-4),     # the diffusion LM keeps its run
    ("grpo_math", ["--model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct"], 100, 1e-6),  # another model: TRL's
    ("grpo_math", ["--max_steps", "7"], 7, 3e-4),                            # a flag wins
    ("grpo_vision", [], 120, 1e-3),                                          # the image VLM (docs/vision.md)
    ("grpo_vision", ["--dataset_name", "embedded-vlm-video"], 120, 1e-3),    # the video VLM too
    ("grpo_vision", ["--model_name_or_path", "Qwen/Qwen2-VL-2B-Instruct"], 60, 1e-6),  # another model: the script's
])
def test_each_shipped_model_gets_its_own_measured_run_length(tmp_path, script, argv, steps, lr):
    from tests.test_scripts import load_script

    cls = {"grpo_math": "GRPOMathConfig", "grpo_vision": "GRPOVisionConfig"}[script]
    cfg = parse_config(getattr(load_script(script), cls), [*argv, "--output_dir", str(tmp_path)])
    assert (cfg.max_steps, cfg.learning_rate) == (steps, lr)
