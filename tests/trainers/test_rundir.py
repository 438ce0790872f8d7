"""Nothing lost, nothing mixed: a run owns its output directory (refusals, overwrite, rotation of its own
checkpoints only, a lock against a second live run), checkpoints are verified before use, a full disk is one
line and leaves the last good checkpoint, and every random state a policy draws from is in the checkpoint."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainers.conftest import tmpfs
from tests.trainers.test_online import make, params
from unialign.config import UserError, exit_on_user_error
from unialign.files import DiskFullError
from unialign.trainers import finish_run, rundir
from unialign.trainers.checkpoint import (
    find_checkpoint,
    generator_states,
    list_checkpoints,
    set_generator_states,
)


def run_to_end(tmp_path, **kw):
    trainer = make(tmp_path, **kw)
    trainer.train()
    finish_run(trainer.acc, trainer.cfg, {"steps": trainer.step}, trainer.policy.save)
    return trainer


# ------------------------------------------------------------------ ownership
def test_a_fresh_run_over_another_runs_outputs_is_refused_with_one_line(tmp_path, capsys):
    run_to_end(tmp_path, save_steps=1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        make(tmp_path)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "holds another run's outputs (checkpoint-1, checkpoint-2, final, summary.json)" in err
    assert "--resume_from_checkpoint latest" in err and "--overwrite_output_dir" in err


def test_an_empty_output_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="--output_dir: empty"):
        make("")
    assert not list(tmp_path.iterdir())


def test_overwrite_moves_the_previous_run_aside_and_rotation_touches_only_its_own(tmp_path, capsys):
    first = run_to_end(tmp_path, save_steps=1, max_steps=3, save_total_limit=3)
    old_id = first.run.run_id
    note = tmp_path / "checkpoint-1" / "notes.txt"  # a person's note inside a checkpoint
    note.write_text("keep me")
    odd = tmp_path / "checkpoint-v2"  # resembles a checkpoint: never parsed, never deleted
    odd.mkdir()
    (odd / "trainer_state.json").write_text("{}")
    (tmp_path / "mine.txt").write_text("a person's file")
    second = make(tmp_path, max_steps=3, save_steps=1, save_total_limit=1, overwrite_output_dir=True, seed=1)
    aside = tmp_path / f"replaced-{old_id}"
    assert f"were moved to {aside}" in capsys.readouterr().err
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "final",
                                                        "summary.json"]
    assert (aside / "checkpoint-1" / "notes.txt").read_text() == "keep me"
    second.train()
    assert second.run.run_id != old_id
    assert json.loads((tmp_path / "run.json").read_text())["replaces_run"] == old_id
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]  # its own rotation, limit 1
    assert odd.exists() and (tmp_path / "mine.txt").exists()
    assert len(list_checkpoints(aside)) == 3  # the previous run's checkpoints untouched
    assert find_checkpoint(tmp_path, "latest") == tmp_path / "checkpoint-3"
    finish_run(second.acc, second.cfg, {"steps": second.step}, second.policy.save)  # checkpoint-v2 is no obstacle
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3


def test_a_folder_named_like_a_checkpoint_that_no_run_wrote_is_refused_at_start(tmp_path):
    users = tmp_path / "checkpoint-2"
    users.mkdir()
    (users / "data.txt").write_text("keep me")
    with pytest.raises(UserError, match=r"folders named like this run's checkpoints that no run wrote \(checkpoint-2\)"):
        make(tmp_path, overwrite_output_dir=True)
    assert (users / "data.txt").exists()


def test_a_checkpoint_never_replaces_a_folder_the_run_did_not_write(tmp_path):
    trainer = make(tmp_path, max_steps=1)
    (tmp_path / "checkpoint-1").mkdir()  # appeared after the start
    (tmp_path / "checkpoint-1" / "data.txt").write_text("keep me")
    with pytest.raises(ValueError, match="checkpoint-1: exists and was not written by this run"):
        trainer.train()
    assert (tmp_path / "checkpoint-1" / "data.txt").exists()


@pytest.mark.slow
def test_tracker_logs_of_two_runs_do_not_mix(tmp_path):
    run_to_end(tmp_path, report_to="tensorboard")
    run_to_end(tmp_path, report_to="tensorboard", overwrite_output_dir=True)
    runs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert len(runs) == 2 and all(list((tmp_path / "logs" / r).rglob("events.out.tfevents.*")) for r in runs)


# ------------------------------------------------------------------ the lock
def _lock(tmp_path, **fields):
    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "run_id": "x", **fields}))


HOLD = """import sys, time
from unialign.trainers import rundir
rundir.claim(sys.argv[1], False, False)
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_second_live_run_on_the_same_directory_is_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"in use by another live run \\(pid {holder.pid} on host"):
            make(tmp_path)
    finally:
        holder.kill()  # kill -9: the kernel drops its lock; the file stays behind
        holder.wait()
    assert json.loads((tmp_path / rundir.LOCK_FILE).read_text())["pid"] == holder.pid
    trainer = make(tmp_path)  # the holder is gone: its lock is free
    assert json.loads((tmp_path / rundir.LOCK_FILE).read_text())["pid"] == os.getpid()
    trainer.train()
    finish_run(trainer.acc, trainer.cfg, {}, trainer.policy.save)
    assert not (tmp_path / rundir.LOCK_FILE).exists()  # released when the run ends


def test_a_reused_pid_does_not_keep_a_dead_runs_lock(tmp_path):
    _lock(tmp_path, pid=os.getppid(), start_time="1")  # a live process, but not the one that took the lock
    make(tmp_path)


def test_another_hosts_lock_is_refused_with_how_to_clear_it(tmp_path):
    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "run_id": "x"}))
    with pytest.raises(UserError, match="on host elsewhere.*delete .*unialign.lock"):
        make(tmp_path)


# ------------------------------------------------------------------ checkpoints verified before use
def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_latest_falls_back(tmp_path, capsys):
    run_to_end(tmp_path, save_steps=1, max_steps=3, save_total_limit=3)
    _flip_a_byte(tmp_path / "checkpoint-3" / "model.safetensors")
    with pytest.raises(ValueError, match="checkpoint-3/model.safetensors: checksum mismatch"):
        find_checkpoint(tmp_path, str(tmp_path / "checkpoint-3"))
    assert find_checkpoint(tmp_path, "latest") == tmp_path / "checkpoint-2"
    assert "resuming checkpoint-2, the newest good checkpoint; skipped:" in capsys.readouterr().err
    (tmp_path / "checkpoint-2" / "optimizer.bin").write_bytes(b"truncated")
    assert find_checkpoint(tmp_path, "latest") == tmp_path / "checkpoint-1"
    resumed = make(tmp_path, max_steps=3, save_steps=1, resume_from_checkpoint="latest")
    resumed.train()
    assert resumed.history[0]["step"] == 1 and resumed.step == 3


@pytest.mark.parametrize("edit,message", [
    ({"step": 9999}, "step 9999 does not match the folder's step 2"),
    ({"step": "2"}, "'step' is '2', not a non-negative integer"),
    ({"cursor": -1}, "'cursor' is -1"),
    ({"history": {}}, "'history' is {}, not a JSON list"),
])
def test_an_edited_trainer_state_is_refused(tmp_path, edit, message):
    run_to_end(tmp_path)
    path = tmp_path / "checkpoint-2" / "trainer_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    (tmp_path / "checkpoint-2" / "checksums.json").unlink()  # not caught by the checksum alone
    state = json.loads(path.read_text())
    state.pop("checkpoint_format")
    path.write_text(json.dumps(state))
    with pytest.raises(UserError, match=message):
        make(tmp_path, max_steps=3, resume_from_checkpoint="latest")


def test_a_checkpoint_past_max_steps_is_refused(tmp_path):
    run_to_end(tmp_path, max_steps=3)
    with pytest.raises(UserError, match="at step 3, past --max_steps 2"):
        make(tmp_path, max_steps=2, resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


def test_resume_with_more_steps_needs_no_flag_on_a_constant_schedule(tmp_path):
    run_to_end(tmp_path)
    resumed = make(tmp_path, max_steps=4, resume_from_checkpoint="latest")
    resumed.train()
    assert resumed.step == 4 and resumed.config_changes == []


# ------------------------------------------------------------------ a full disk
def test_disk_full_is_one_line_the_partial_copy_is_removed_and_the_last_good_one_is_intact(tmp_path, monkeypatch):
    trainer = make(tmp_path, max_steps=2)
    trainer.train()
    good = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-2").iterdir()}
    real = trainer.acc.save_state

    def save_state_until_full(path, **kw):
        real(path, **kw)
        with open(os.path.join(path, "big.bin"), "wb") as f:
            f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.acc, "save_state", save_state_until_full)
    trainer.step = 3
    with pytest.raises(DiskFullError, match=r"disk full \(ENOSPC\) while writing checkpoint .*checkpoint-3"):
        trainer.save_checkpoint()
    assert not (tmp_path / ".tmp-checkpoint-3").exists() and not (tmp_path / "checkpoint-3").exists()
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-2").iterdir()} == good
    assert find_checkpoint(tmp_path, "latest") == tmp_path / "checkpoint-2"


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path, "3m") as mount:
        yield mount


def test_a_real_full_disk(small_disk):
    """A 3 MB file system: the first checkpoints fit, then the disk fills; one line, the last good one intact."""
    filler = small_disk / "filler"
    trainer = make(small_disk, max_steps=2, save_total_limit=5)
    trainer.train()  # checkpoint-2 fits
    good = {p.name: p.read_bytes() for p in (small_disk / "checkpoint-2").iterdir()}
    free = shutil.disk_usage(small_disk).free
    filler.write_bytes(b"\0" * max(0, free - 64 * 1024))  # leave less than one checkpoint
    trainer.step = 3
    with pytest.raises(DiskFullError, match="ENOSPC"):
        trainer.save_checkpoint()
    assert not (small_disk / ".tmp-checkpoint-3").exists()
    assert {p.name: p.read_bytes() for p in (small_disk / "checkpoint-2").iterdir()} == good
    rundir.release(small_disk)


# ------------------------------------------------------------------ every random state
class Drawing:
    """A stand-in for a policy that draws from a generator of its own."""

    def __init__(self, seed):
        self.generator = torch.Generator().manual_seed(seed)

    def generators(self):
        return {"generator": self.generator}


def test_a_policys_own_generator_round_trips(tmp_path):
    a = Drawing(0)
    torch.rand(5, generator=a.generator)
    states = generator_states({"policy": a})
    expected = torch.rand(3, generator=a.generator)
    b = Drawing(123)
    set_generator_states({"policy": b}, states, tmp_path)
    assert torch.equal(torch.rand(3, generator=b.generator), expected)
    with pytest.raises(ValueError, match="holds no state for the generators"):
        set_generator_states({"policy": b, "reward": Drawing(1)}, states, tmp_path)


def test_a_time_based_checkpoint_changes_nothing(tmp_path):
    plain = make(tmp_path / "a", max_steps=3)
    plain.train()
    timed = make(tmp_path / "b", max_steps=3, save_minutes=1e-9)  # a checkpoint after every step
    timed.train()
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["checkpoint-2", "checkpoint-3"]
    assert all(torch.equal(v, params(timed)[k]) for k, v in params(plain).items())


# ------------------------------------------------------------------ signals, in process
@pytest.mark.parametrize("when", ["mid-run", "final evaluation"])
def test_sigterm_finishes_the_step_saves_and_exits_143(tmp_path, capsys, when):
    import signal

    trainer = make(tmp_path, max_steps=4)
    if when == "mid-run":
        step = trainer.train_step

        def step_then_signal():
            out = step()
            if trainer.step == 1:  # the second step: the signal lands while it runs
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        trainer.train_step = step_then_signal
        saved = "checkpoint-2"
    else:
        trainer.evaluate = lambda: os.kill(os.getpid(), signal.SIGTERM)
        saved = "checkpoint-4"
    with pytest.raises(SystemExit) as exit_info:
        trainer.train()
    assert exit_info.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert f"stopped by SIGTERM after step {saved[11:]} of 4: saved {tmp_path / saved}" in err
    assert [p.name for p in list_checkpoints(tmp_path)] == [saved]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the run


def _contend(folders, barrier, results, me):
    """One contender: in each trial, take the trial's lock with the others at once; hold it until all have tried."""
    from unialign.trainers import rundir as rd

    for t, folder in enumerate(folders):
        barrier.wait()
        try:
            rd._take_lock(Path(folder), f"{me:016x}")
            got = True
        except UserError:
            got = False
        results.put((t, me, got))
        barrier.wait()
        if got:
            rd._drop_lock(Path(folder) / rd.LOCK_FILE)


@pytest.mark.slow
def test_many_contenders_on_a_stale_lock_never_make_two_holders(tmp_path):
    """4 processes take the same stale lock at once, 200 times: exactly one holds it each time (the kernel's flock;
    the previous rename-away of a stale lock gave two holders in 10 of 200 trials)."""
    import multiprocessing

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folders = []
    for t in range(200):
        folder = tmp_path / f"t{t}"
        folder.mkdir()
        _lock(folder, pid=dead.pid, start_time="1")  # left by a killed run
        folders.append(str(folder))
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(folders, barrier, results, k)) for k in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(4 * len(folders))]
    for p in procs:
        p.join(timeout=60)
    holders = [sum(g for t, _, g in got if t == trial) for trial in range(len(folders))]
    assert holders == [1] * len(folders)


def test_a_full_disk_at_start_leaves_no_lock_debris(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        out = mount / "run"
        out.mkdir()
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        with pytest.raises(DiskFullError, match="while writing the (lock|run record)"):
            rundir.claim(out, False, False)
        assert sorted(p.name for p in out.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


# ------------------------------------------------------------------ the checksum check cannot be talked out of
def test_an_emptied_checksum_list_does_not_let_a_corrupted_file_load(tmp_path):
    run_to_end(tmp_path)
    ckpt = tmp_path / "checkpoint-2"
    _flip_a_byte(ckpt / "model.safetensors")
    (ckpt / "checksums.json").write_text(json.dumps({"algorithm": "sha256", "files": {}}))
    with pytest.raises(ValueError, match="checkpoint-2/.*: not in checksums.json .a file a resume reads, unverified."):
        find_checkpoint(tmp_path, str(ckpt))
    with pytest.raises(UserError, match="no good checkpoint"):
        make(tmp_path, max_steps=3, resume_from_checkpoint="latest")


@pytest.mark.slow
def test_a_checkpoint_stripped_of_its_checksums_and_format_is_refused_until_sealed(tmp_path):
    run_to_end(tmp_path)
    ckpt = tmp_path / "checkpoint-2"
    _flip_a_byte(ckpt / "optimizer.bin")  # would load silently as an "older" checkpoint
    (ckpt / "checksums.json").unlink()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    for key in ("checkpoint_format", "run_id"):
        state.pop(key)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="checksums.json: missing; the checkpoint is damaged or was written before "
                                         "checksums were recorded: .* `python -m unialign.trainers.checkpoint seal"):
        find_checkpoint(tmp_path, str(ckpt))
    sealed = subprocess.run([sys.executable, "-m", "unialign.trainers.checkpoint", "seal", str(ckpt)],
                            capture_output=True, text=True, timeout=120)
    assert sealed.returncode == 0 and (ckpt / "checksums.json").is_file(), sealed.stderr
    assert find_checkpoint(tmp_path, str(ckpt)) == ckpt  # the person vouched for it


def test_a_run_id_that_names_another_folder_is_refused(tmp_path):
    run_to_end(tmp_path)
    ckpt = tmp_path / "checkpoint-2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["run_id"] = "../../elsewhere"
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    from tests.trainers.test_resume import reseal

    reseal(ckpt)
    with pytest.raises(ValueError, match="'run_id' is '../../elsewhere', not a run id"):
        find_checkpoint(tmp_path, str(ckpt))
