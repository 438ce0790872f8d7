"""A resume is a continuation, for every entry point: a run stopped after a checkpoint and resumed from it (the
checkpoint copied to a fresh directory, or the run killed with SIGKILL / stopped by SIGTERM) ends with the final
weights and summary of the uninterrupted run, bit for bit (wall-clock fields aside)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_scripts import run

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["--report_to", "none", "--save_steps", "2"]
IMAGE = ["--num_eval", "4", "--prompts_per_step", "2", "--num_generations", "4", "--micro_batch_size", "8"]
SCRIPTS = {  # each script's embedded default, shrunk; 4 steps with a checkpoint at step 2
    "grpo_math": ["--num_eval", "8", "--prompts_per_step", "2", "--num_generations", "4"],
    "dpo_text": ["--num_eval", "8", "--batch_size", "8", "--micro_batch_size", "4"],
    "train_reward_model": ["--num_eval", "8", "--batch_size", "8"],
    "ddpo_aesthetic": IMAGE,
    "grpo_image": [*IMAGE, "--model_name_or_path", "embedded-sd3"],
    # forward-process RL with DiffusionNFT's old policy, a moving average kept in the checkpoint
    "grpo_image:nft": [*IMAGE, "--model_name_or_path", "embedded-sd3", "--algorithm", "nft"],
    # DGPO (its clip's old policy, a moving average; pairs shared by each group) and GRPO-Guard (recorded step means)
    "grpo_image:dgpo": [*IMAGE, "--model_name_or_path", "embedded-sd3", "--algorithm", "dgpo"],
    "grpo_image:grpo_guard": [*IMAGE, "--model_name_or_path", "embedded-sd3", "--algorithm", "grpo_guard",
                              "--num_iterations", "2"],
    "dpo_sdxl": ["--num_prompts", "4", "--pairs_per_prompt", "2", "--eval_pairs_per_prompt", "2", "--min_gap", "0",
                 "--batch_size", "4", "--micro_batch_size", "4", "--eval_timestep_samples", "1",
                 "--num_eval_images", "4", "--caption_dropout", "0.5"],
}
TIMING = ("wall_seconds", "seconds", "step_seconds", "tokens_per_second", "samples_per_second", "pairs_per_second")
PATHS = ("comparison_image",)  # files in the run's own output_dir


def comparable(summary: dict) -> dict:
    """A summary without what legitimately differs between two runs of the same maths: timings and paths."""
    out = {k: v for k, v in summary.items() if not any(t in k for t in TIMING) and k not in PATHS}
    out["config"] = {k: v for k, v in summary["config"].items()
                     if k not in ("output_dir", "resume_from_checkpoint", "reward_model_path", "save_steps")}
    return out


def weights(final: Path) -> dict[str, torch.Tensor]:
    files = sorted(final.rglob("*.safetensors"))
    assert files, f"no weights under {final}"
    return {f"{f.relative_to(final)}:{k}": v for f in files for k, v in load_file(str(f)).items()}


def assert_same_run(a: Path, b: Path) -> None:
    wa, wb = weights(a / "final"), weights(b / "final")
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} of {len(wa)} tensors differ, e.g. {different[:3]}"
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert comparable(sa) == comparable(sb)


def extra(name: str, tmp_path: Path) -> list[str]:
    if name != "ppo_rlhf":
        return []
    rm = tmp_path / "rm"
    if not (rm / "final").exists():
        run("train_reward_model", ["--max_steps", "2", "--num_eval", "8", "--batch_size", "8", "--output_dir", str(rm),
                                   "--report_to", "none"])
    return ["--reward_model_path", str(rm / "final")]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*SCRIPTS, "ppo_rlhf"])
def test_resume_from_a_copied_checkpoint_is_the_uninterrupted_run(tmp_path, name):
    args = SCRIPTS.get(name, ["--num_eval", "8", "--prompts_per_step", "4", "--micro_batch_size", "4"])
    args = [*args, *QUIET, "--max_steps", "4", *extra(name, tmp_path)]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    script = name.split(":")[0]
    run(script, [*args, "--output_dir", str(whole)])
    assert (whole / "checkpoint-2").is_dir()
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")  # the run as a kill after step 2 leaves it
    run(script, [*args, "--output_dir", str(resumed), "--resume_from_checkpoint", str(resumed / "checkpoint-2")])
    assert_same_run(whole, resumed)


def _launch(script: str, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / f"{script}.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path.name}: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.05)


# a step of the embedded GRPO takes ~0.2 s here: 40 leave a signal sent after checkpoint-1 time to land mid-run
GRPO = ["--num_eval", "8", "--prompts_per_step", "2", "--num_generations", "4", "--report_to", "none",
        "--max_steps", "40", "--save_steps", "1", "--save_total_limit", "2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole")
    run("grpo_math", [*GRPO, "--output_dir", str(out)])
    return out


@pytest.mark.slow
def test_sigkill_then_resume_latest_is_the_uninterrupted_run(tmp_path, uninterrupted):
    out = tmp_path / "killed"
    proc = _launch("grpo_math", [*GRPO, "--output_dir", str(out)])
    _wait_for(out / "checkpoint-2", proc)
    proc.kill()  # SIGKILL: nothing runs after it
    proc.wait()
    assert not (out / "final").exists()
    run("grpo_math", [*GRPO, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert_same_run(uninterrupted, out)


@pytest.mark.slow
def test_an_async_run_killed_outright_resumes_as_the_uninterrupted_async_run(tmp_path):
    """--async_rollouts, SIGKILL while the rollout thread samples ahead: the resume samples the pending batch again
    from the weights it was sampled from and ends where the uninterrupted async run does."""
    args = [*GRPO, "--max_steps", "12", "--async_rollouts", "true", "--max_staleness", "2"]
    whole = tmp_path / "whole"
    run("grpo_math", [*args, "--output_dir", str(whole)])
    out = tmp_path / "killed"
    proc = _launch("grpo_math", [*args, "--output_dir", str(out)])
    _wait_for(out / "checkpoint-3", proc)
    proc.kill()
    proc.wait()
    assert not (out / "final").exists()
    run("grpo_math", [*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert_same_run(whole, out)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_exits_non_zero_naming_it(tmp_path, uninterrupted, sig):
    out = tmp_path / "stopped"
    proc = _launch("grpo_math", [*GRPO, "--output_dir", str(out)])
    _wait_for(out / "checkpoint-1", proc)  # the loop runs, its handlers are in place
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + sig, err[-2000:]
    line = next(ln for ln in err.splitlines() if ln.startswith(f"stopped by {signal.Signals(sig).name}"))
    ckpt = Path(line.split("saved ")[1].split(";")[0])
    assert ckpt.is_dir() and ckpt.parent == out and "--resume_from_checkpoint latest" in line
    assert not (out / "final").exists() and not (out / ".unialign.lock").exists()  # the lock is released at exit
    run("grpo_math", [*GRPO, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert_same_run(uninterrupted, out)


FAKE_LAUNCHER = '''"""accelerate launch as far as the child sees it: its parent, named `accelerate launch`, piping its stderr."""
import subprocess, sys
child = subprocess.Popen([sys.executable, *sys.argv[2:]], stderr=subprocess.PIPE)
print(child.pid, flush=True)
for chunk in iter(lambda: child.stderr.read1(4096), b""):
    sys.stderr.buffer.write(chunk)
child.wait()
'''


@pytest.mark.slow
def test_a_launcher_killed_outright_stops_its_run_with_a_checkpoint(tmp_path, uninterrupted):
    """kill -9 of the launcher (an OOM kill, a scheduler, an older accelerate that exits on SIGTERM alone): the
    training child is told by the kernel (PR_SET_PDEATHSIG), finishes its step, saves, releases the lock and exits;
    its stderr, piped to the dead launcher, goes to after_launcher_exit.log. The resume is the uninterrupted run."""
    out = tmp_path / "orphan"
    launcher_file = tmp_path / "bin" / "accelerate"
    launcher_file.parent.mkdir()
    launcher_file.write_text(FAKE_LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    launcher = subprocess.Popen([sys.executable, str(launcher_file), "launch", str(ROOT / "scripts" / "grpo_math.py"),
                                 *GRPO, "--output_dir", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    child = int(launcher.stdout.readline())
    _wait_for(out / "checkpoint-1", launcher)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 120
    while Path(f"/proc/{child}").exists() and open(f"/proc/{child}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the orphaned run did not stop"
        time.sleep(0.1)
    log = (out / "after_launcher_exit.log").read_text()
    assert "the launcher exited: finishing this step, then saving a checkpoint" in log
    line = next(ln for ln in log.splitlines() if ln.startswith("stopped by SIGTERM after step"))
    assert Path(line.split("saved ")[1].split(";")[0]).is_dir()
    assert not (out / ".unialign.lock").exists() and not (out / "final").exists()
    run("grpo_math", [*GRPO, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert_same_run(uninterrupted, out)


@pytest.mark.slow
def test_sigterm_to_accelerate_launch_saves_a_checkpoint(tmp_path, uninterrupted):
    """The documented launcher: accelerate launch passes SIGTERM on to the training process (and kills it 5 s
    later if it is still running); the run saves after its step, exits 143 naming the checkpoint, and resumes to
    the uninterrupted run."""
    out = tmp_path / "launched"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default"], env=env,
                   check=True, capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
                             str(ROOT / "scripts" / "grpo_math.py"), *GRPO, "--output_dir", str(out)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "checkpoint-1", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    line = next(ln for ln in err.splitlines() if ln.startswith("stopped by SIGTERM after step"))
    assert Path(line.split("saved ")[1].split(";")[0]).is_dir() and not (out / ".unialign.lock").exists()
    run("grpo_math", [*GRPO, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert_same_run(uninterrupted, out)
