"""ppo_rlhf.py writes only under --output_dir: the embedded reward model is trained into
<output_dir>/reward_model (for --reward_model_steps steps), reused when there, resumed when killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_scripts import ROOT, load_script
from unialign.config import parse_config
from unialign.errors import UserError
from unialign.recipes.text import reward_model_folder


@pytest.mark.slow
def test_a_short_run_writes_nothing_outside_its_output_dir(tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    argv = ["--max_steps", "1", "--reward_model_steps", "2", "--output_dir", "run", "--num_eval", "8",
            "--prompts_per_step", "4", "--micro_batch_size", "4", "--report_to", "none"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ppo_rlhf.py"), *argv], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in work.iterdir()) == ["run"]  # no ./outputs/reward_model beside it
    rm = work / "run" / "reward_model"
    assert json.loads((rm / "summary.json").read_text())["steps"] == 2  # the budget reached train_reward_model.py
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["steps"] == 1
    assert summary["config"]["reward_model_path"] == str(Path("run") / "reward_model" / "final")
    assert (rm / "final" / "config.json").exists() and (work / "run" / "final").exists()


@pytest.fixture
def ppo(monkeypatch):
    """The script module with the reward model's trainer launch recorded (and run as ``result`` says) instead of
    training; ``module.reward_model(cfg)``: the folder ``recipes.text.reward_model_folder`` gives the script."""
    module = load_script("ppo_rlhf")
    module.reward_model = lambda cfg: reward_model_folder(cfg, ROOT / "scripts" / "train_reward_model.py")
    calls, result = [], {"returncode": 0}

    def fake_run(cmd, *args, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, result["returncode"])

    monkeypatch.setattr(subprocess, "run", fake_run)
    return module, calls, result


def _cfg(module, tmp_path, *argv):
    return parse_config(module.PPOConfig, ["--output_dir", str(tmp_path / "run"), *argv], presets=module.PRESETS)


def test_the_embedded_reward_model_goes_under_output_dir_with_its_budget(ppo, tmp_path):
    module, calls, _ = ppo
    path = module.reward_model(_cfg(module, tmp_path, "--reward_model_steps", "3"))
    rm = tmp_path / "run" / "reward_model"
    assert path == rm / "final" and len(calls) == 1
    cmd = calls[0]
    assert cmd[1].endswith("train_reward_model.py") and cmd[cmd.index("--output_dir") + 1] == str(rm)
    assert cmd[cmd.index("--max_steps") + 1] == "3" and "--resume_from_checkpoint" not in cmd
    calls.clear()
    module.reward_model(_cfg(module, tmp_path))
    assert "--max_steps" not in calls[0]  # unset: train_reward_model.py's own default


def test_a_killed_reward_model_is_resumed_and_a_finished_one_reused(ppo, tmp_path):
    module, calls, _ = ppo
    rm = tmp_path / "run" / "reward_model"
    (rm / "checkpoint-2").mkdir(parents=True)
    (rm / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"step": 2}))
    module.reward_model(_cfg(module, tmp_path))
    assert calls[-1][-2:] == ["--resume_from_checkpoint", "latest"]
    (rm / "final").mkdir()
    calls.clear()
    assert module.reward_model(_cfg(module, tmp_path, "--reward_model_steps", "5")) == rm / "final" and calls == []


def test_a_given_reward_model_is_used_as_it_is_and_a_failed_training_is_one_line(ppo, tmp_path):
    module, calls, result = ppo
    assert module.reward_model(_cfg(module, tmp_path, "--reward_model_path", "elsewhere/rm")) == Path("elsewhere/rm")
    assert calls == []
    with pytest.raises(UserError, match="--reward_model_steps"):
        module.reward_model(_cfg(module, tmp_path, "--reward_model_path", "elsewhere/rm", "--reward_model_steps", "2"))
    result["returncode"] = 2
    with pytest.raises(UserError, match="reward_model failed .exit status 2"):
        module.reward_model(_cfg(module, tmp_path))
    with pytest.raises(UserError, match="--reward_model_steps: must be >= 1"):
        _cfg(module, tmp_path, "--reward_model_steps", "0")
