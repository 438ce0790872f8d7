"""The text scripts on the shipped masked-diffusion LM (``embedded-mdlm``) and the diffusion-LM hub presets."""

from __future__ import annotations

import json
import time

import pytest

from tests.test_scripts import load_script, run
from unialign.config import exit_on_user_error, parse_config


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "spg", "just_grpo"])
def test_grpo_math_on_the_embedded_masked_diffusion_lm(tmp_path, algorithm):
    run("grpo_math", ["--model_name_or_path", "embedded-mdlm", "--algorithm", algorithm, "--max_steps", "1",
                      "--num_eval", "8", "--prompts_per_step", "2", "--num_generations", "4", "--num_iterations", "1",
                      "--report_to", "none", "--output_dir", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 1 and (tmp_path / "final" / "model.safetensors").is_file()
    assert (tmp_path / "completions.jsonl").is_file()
    want = {"grpo": "one_step", "spg": "spg", "just_grpo": "ar_order"}[algorithm]
    assert json.dumps({"log_prob_estimator": want})[1:-1] in (tmp_path / "summary.json").read_text()  # recorded


@pytest.mark.slow
def test_dpo_text_vrpo_on_the_embedded_masked_diffusion_lm(tmp_path):
    run("dpo_text", ["--model_name_or_path", "embedded-mdlm", "--algorithm", "vrpo", "--rpo_alpha", "0",
                     "--max_steps", "1", "--num_eval", "8", "--batch_size", "4", "--micro_batch_size", "4", "--report_to", "none",
                     "--output_dir", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first_loss"] == pytest.approx(0.6931, abs=1e-3)  # shared masks: policy = reference at step 0


def test_vrpo_is_refused_on_a_causal_lm(tmp_path, capsys):
    module = load_script("dpo_text")
    with pytest.raises(SystemExit), exit_on_user_error():
        module.main(parse_config(module.DPOTextConfig, ["--algorithm", "vrpo", "--max_steps", "1",
                                                        "--output_dir", str(tmp_path)], presets=module.PRESETS))
    assert "vrpo is DPO for masked-diffusion LMs" in capsys.readouterr().err


@pytest.mark.parametrize("preset,extra,message", [
    ("llada-8b-instruct-gsm8k", [], "pass --trust_remote_code"),
    ("llada-8b-instruct-gsm8k", ["--trust_remote_code"], "GSAI-ML/LLaDA-8B-Instruct"),
    ("dream-7b-coupled", [], "pass --trust_remote_code"),
    ("dream-7b-coupled", ["--trust_remote_code"], "Dream-org/Dream-v0-Instruct-7B"),
    ("modernbert-chat-gsm8k", [], "dllm-collection/ModernBERT-large-chat-v0"),
])
def test_the_diffusion_lm_presets_fail_fast_offline(monkeypatch, capsys, tmp_path, preset, extra, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    module = load_script("grpo_math")
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        module.main(parse_config(module.GRPOMathConfig, ["--preset", preset, "--output_dir", str(tmp_path), *extra],
                                 presets=module.PRESETS))
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert time.perf_counter() - start < 30
