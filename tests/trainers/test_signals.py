"""Signals around the final save: the first SIGTERM / SIGINT lets final/ and summary.json finish, then the run exits
128 + the signal with one line; a second one stops at once after a line saying what is not written, and the resume
writes it (the killed save's temporary folder removed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainers.test_online import make
from tests.trainers.test_writes import partials
from unialign.trainers import finish_run

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_during_the_final_save_lets_it_finish_then_exits_143(tmp_path, capsys):
    trainer = make(tmp_path, max_steps=2)
    trainer.train()

    def save(path):
        os.kill(os.getpid(), signal.SIGTERM)  # lands while final/ is being written
        trainer.policy.save(path)

    with pytest.raises(SystemExit) as exit_info:
        finish_run(trainer.acc, trainer.cfg, {"steps": 2}, save)
    assert exit_info.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "SIGTERM received: finishing the final save, then stopping" in err
    assert f"stopped by SIGTERM during the final save, after it finished: final/ and summary.json are in {tmp_path}" in err
    assert (tmp_path / "final" / "config.json").is_file() and json.loads((tmp_path / "summary.json").read_text())
    assert partials(tmp_path) == [] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


SECOND = """import os, signal, sys, time
sys.path.insert(0, sys.argv[2])
from tests.trainers.test_online import make
from unialign.trainers import finish_run
trainer = make(sys.argv[1], max_steps=2)
trainer.train()
def save(path):
    open(os.path.join(path, "half.bin"), "wb").write(b"x")
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
finish_run(trainer.acc, trainer.cfg, {"steps": 2}, save)
"""


@pytest.mark.slow
def test_a_second_sigterm_during_the_final_save_stops_at_once_and_the_resume_writes_it(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SECOND, str(tmp_path), str(ROOT)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"})
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    assert (f"SIGTERM again: stopping now; final/ is not written (the last checkpoint, {tmp_path / 'checkpoint-2'}, "
            "is whole: --resume_from_checkpoint latest writes it)") in proc.stderr
    assert not (tmp_path / "final").exists() and len(partials(tmp_path)) == 1  # the killed save's folder
    resumed = make(tmp_path, max_steps=2, resume_from_checkpoint="latest")
    resumed.train()
    finish_run(resumed.acc, resumed.cfg, {"steps": 2}, resumed.policy.save)
    assert (tmp_path / "final" / "config.json").is_file() and partials(tmp_path) == []
