"""A plain ``accelerate launch scripts/...`` warns, before any project code runs, that --num_processes,
--num_machines, --mixed_precision and --dynamo_backend were not passed, unless accelerate finds a config file:
``--config_file`` or ``$HF_HOME/accelerate/default_config.yaml`` (``~/.cache/huggingface/accelerate/`` without
HF_HOME; accelerate/commands/launch.py, ``_validate_launch_command``). Nothing a project ships is read there, so
the fix is the user's one line ``accelerate config default``; this checks that it silences those four."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FLAGS = ("--num_processes", "--num_machines", "--mixed_precision", "--dynamo_backend")


def _accelerate(args: list[str], env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_accelerate_config_default_silences_the_launch_defaults_warning(tmp_path):
    (tmp_path / "tiny.py").write_text("print('launched')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "OMP_NUM_THREADS")}
    env["HF_HOME"] = str(tmp_path / "hf")  # never the user's own config
    made = _accelerate(["config", "default"], env, tmp_path)
    assert made.returncode == 0 and (tmp_path / "hf" / "accelerate" / "default_config.yaml").is_file(), made.stderr
    launched = _accelerate(["launch", "tiny.py"], env, tmp_path)
    assert launched.returncode == 0 and "launched" in launched.stdout, launched.stderr[-2000:]
    # a CPU-only machine may still get one note, --num_cpu_threads_per_process (gone with OMP_NUM_THREADS set)
    assert not [f for f in FLAGS if f"`{f}` was set" in launched.stderr], launched.stderr


@pytest.mark.slow
def test_a_scripts_one_line_error_is_the_last_line_under_accelerate_launch_quiet(tmp_path):
    """``accelerate launch`` re-raises a failed script as its own ``CalledProcessError`` traceback, burying the
    script's one line; accelerate's ``-q`` (``--quiet``) drops that traceback, so the error is the last line (exit
    status 1, accelerate's; ``python scripts/...`` exits 2). The README and quick start say so."""
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME",)}
    env["HF_HOME"] = str(tmp_path / "hf")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [os.path.join(root, "scripts", "grpo_math.py"), "--model_name_or_path", "embeded",
            "--output_dir", str(tmp_path / "out")]
    quiet = _accelerate(["launch", "-q", *argv], env, tmp_path)
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr, quiet.stderr[-2000:]
    assert quiet.stderr.strip().splitlines()[-1].startswith("error: --model_name_or_path: 'embeded'")
    loud = _accelerate(["launch", *argv], env, tmp_path)  # what -q is for
    assert loud.returncode != 0 and "CalledProcessError" in loud.stderr
