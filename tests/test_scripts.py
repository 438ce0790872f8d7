"""Two-step smoke runs of every entry point, in-process (the scripts are thin: parse config, call library)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run(name: str, argv: list[str]) -> dict:
    from unialign.config import parse_config

    module = load_script(name)
    cfg_cls = next(v for k, v in vars(module).items() if k.endswith("Config") and isinstance(v, type)
                   and v.__module__ == module.__name__)
    return module.main(parse_config(cfg_cls, argv, presets=module.PRESETS))


def check_summary(out: Path, metric: str) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == metric
    assert all(math.isfinite(summary[k]) for k in ("before", "after", "wall_seconds"))
    return summary


def test_grpo_math_two_steps(tmp_path):
    run("grpo_math", ["--max_steps", "2", "--num_eval", "16", "--prompts_per_step", "2", "--num_generations", "4",
                      "--output_dir", str(tmp_path), "--report_to", "none"])
    s = check_summary(tmp_path, "accuracy")
    assert s["steps"] == 2 and (tmp_path / "reward_curve.png").exists() and (tmp_path / "final" / "config.json").exists()


def test_grpo_math_dapo_and_resume(tmp_path):
    common = ["--algorithm", "dapo", "--num_eval", "8", "--prompts_per_step", "2", "--num_generations", "4",
              "--output_dir", str(tmp_path), "--report_to", "none", "--save_steps", "1"]
    run("grpo_math", common + ["--max_steps", "1"])
    run("grpo_math", common + ["--max_steps", "2", "--resume_from_checkpoint", "latest"])
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2


def test_grpo_math_preset_fails_fast_offline(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    module = load_script("grpo_math")
    from unialign.config import exit_on_user_error, parse_config

    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        module.main(parse_config(module.GRPOMathConfig, ["--preset", "qwen2.5-0.5b-gsm8k"], presets=module.PRESETS))
    assert exit_info.value.code == 2 and "openai/gsm8k" in capsys.readouterr().err


def test_dpo_text_two_steps(tmp_path):
    run("dpo_text", ["--max_steps", "2", "--num_eval", "16", "--batch_size", "8", "--micro_batch_size", "4",
                     "--output_dir", str(tmp_path), "--report_to", "none"])
    s = check_summary(tmp_path, "accuracy")
    # default RPO: the DPO part is ln 2 at init, plus rpo_alpha (1.0) x the chosen side's per-token NLL
    assert abs(s["first_loss"] - s["first_nll_loss"] - math.log(2)) < 1e-4 and s["first_nll_loss"] > 0
    assert "implicit_accuracy_after" in s


def test_reward_model_then_ppo_two_steps(tmp_path):
    run("train_reward_model", ["--max_steps", "2", "--num_eval", "16", "--batch_size", "8",
                               "--output_dir", str(tmp_path / "rm"), "--report_to", "none"])
    check_summary(tmp_path / "rm", "pairwise_accuracy")
    run("ppo_rlhf", ["--max_steps", "2", "--num_eval", "16", "--prompts_per_step", "4", "--micro_batch_size", "4",
                     "--reward_model_path", str(tmp_path / "rm" / "final"), "--output_dir", str(tmp_path / "ppo"),
                     "--report_to", "none"])
    s = check_summary(tmp_path / "ppo", "accuracy")
    assert math.isfinite(s["rm_before"]) and math.isfinite(s["rm_after"])


IMAGE_SMOKE = ["--max_steps", "2", "--num_eval", "4", "--prompts_per_step", "2", "--num_generations", "4",
               "--micro_batch_size", "8", "--eval_steps", "1"]


def test_ddpo_aesthetic_two_steps_with_kl(tmp_path):
    run("ddpo_aesthetic", IMAGE_SMOKE + ["--beta", "0.04", "--output_dir", str(tmp_path), "--report_to", "none"])
    s = check_summary(tmp_path, "reward")
    assert {"before_std", "gold_before", "gold_after", "fidelity_before", "fidelity_after", "aesthetic_before",
            "aesthetic_after", "shape_verifier_partial_before", "shape_verifier_partial_after"} <= set(s)
    assert 0.0 <= s["fidelity_before"] <= 1.0 and s["config"]["beta"] == 0.04
    assert all((tmp_path / f).exists() for f in ("grid_before.png", "grid_after.png", "reward_curve.png"))


def test_grpo_image_two_steps_lora_kl_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run("grpo_image", IMAGE_SMOKE + ["--beta", "0.04", "--lora_rank", "4", "--output_dir", str(tmp_path)])
    s = check_summary(tmp_path, "reward")
    assert s["reward"] == "shape_verifier_partial" and {"fidelity_before", "fidelity_after"} <= set(s)
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").exists()
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent),
                              size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    scalars, images = set(events.Tags()["scalars"]), set(events.Tags()["images"])
    assert {"eval/fidelity", "eval/reward", "kl", "reward/shape_verifier_partial/fidelity"} <= scalars
    assert "eval/grid" in images
    assert [e.step for e in events.Scalars("eval/fidelity")] == [0, 1, 2]  # before, every eval_steps, after


def test_image_scripts_reject_bad_input_before_loading(tmp_path, capsys):
    from unialign.config import exit_on_user_error, parse_config

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on a blue background\na cat\n")
    module = load_script("grpo_image")
    for argv, message in ((["--prompt_set", str(prompts)], "prompt_set[1]: shape_verifier: cannot parse prompt 'a cat'"),
                          (["--reward", "aesthetic,shape_verifier", "--reward_weights", "1"], "reward_weights: 1 weights")):
        with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
            module.main(parse_config(module.GRPOImageConfig, argv + ["--output_dir", str(tmp_path)]))
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_dpo_sdxl_two_steps(tmp_path):
    run("dpo_sdxl", ["--max_steps", "2", "--num_prompts", "4", "--pairs_per_prompt", "2", "--eval_pairs_per_prompt", "2",
                     "--min_gap", "0", "--batch_size", "4", "--micro_batch_size", "4", "--eval_timestep_samples", "2",
                     "--num_eval_images", "8", "--gradient_checkpointing", "true", "--optim", "adafactor",
                     "--output_dir", str(tmp_path), "--report_to", "none"])
    s = check_summary(tmp_path, "gold_score")
    assert 0.0 <= s["fidelity_before"] <= 1.0 and 0.0 <= s["fidelity_after"] <= 1.0
    assert abs(s["first_loss"] - math.log(2)) < 1e-4
    # before training the policy is its reference: every margin is 0, a tie counted 1/2, however many draws
    assert s["implicit_accuracy_before"] == s["implicit_accuracy_before_k1"] == 0.5
    assert 0.0 <= s["implicit_accuracy_after"] <= 1.0
