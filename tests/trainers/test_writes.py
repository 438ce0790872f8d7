"""One write policy for every file a run writes (``unialign.files``): a full disk in any writer is one line naming
what was written, the partial file is gone, the last good checkpoint is intact; nothing a person left in the output
directory is deleted or absorbed; links are never written through or deleted."""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.trainers.conftest import full_disk_os, tmpfs
from tests.trainers.test_online import make
from unialign.config import exit_on_user_error
from unialign.files import PARTIAL_RE, DiskFullError, LinkError, append_text, partial_name, write_text
from unialign.trainers import finish_run, rundir
from unialign.trainers.checkpoint import find_checkpoint, list_checkpoints, verify_checkpoint

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def partials(root: Path) -> list[str]:
    """Temporary names of the write policy anywhere under ``root``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if PARTIAL_RE.fullmatch(p.name))


class _FullFile(io.RawIOBase):
    """A file that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, real, room: int):
        self.real, self.room = real, room

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            self.real.write(bytes(data[:self.room]))
            self.room = 0
            self.real.flush()
            raise OSError(errno.ENOSPC, "No space left on device", self.real.name)
        self.room -= len(data)
        return self.real.write(data)

    def close(self):
        self.real.close()
        super().close()


@pytest.fixture
def disk_full_for(monkeypatch):
    """``disk_full_for(stem)``: from now on, a file opened for writing whose name is a temporary name of
    ``stem`` (``.<stem>.partial-...``) takes 10 bytes, then fails with ENOSPC."""

    def arm(stem: str) -> None:
        real_open = builtins.open

        def fake_open(file, mode="r", *args, **kwargs):
            name = os.path.basename(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
            m = PARTIAL_RE.fullmatch(name)
            if m and m.group("name") == stem and any(c in mode for c in "wa"):
                raw = real_open(file, mode.replace("t", "") + ("b" if "b" not in mode else ""))
                wrapped = _FullFile(raw, 10)
                if "b" in mode:
                    return io.BufferedWriter(wrapped)
                return io.TextIOWrapper(io.BufferedWriter(wrapped), encoding=kwargs.get("encoding") or "utf-8")
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)

    return arm


def one_line(capsys, fn) -> str:
    """Run ``fn`` under ``exit_on_user_error``: it must exit 2 with one line; returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        fn()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines, "no error line"
    return lines[-1]


def trained(tmp_path, **kw):
    trainer = make(tmp_path, max_steps=2, save_steps=1, **kw)
    trainer.train()
    return trainer


def intact(ckpt: Path) -> None:
    verify_checkpoint(ckpt)
    assert find_checkpoint(ckpt.parent, "latest") == ckpt


# ------------------------------------------------------------------ ENOSPC in each writer in turn
def test_checkpoint(tmp_path, monkeypatch, capsys):
    trainer = trained(tmp_path)
    real = trainer.acc.save_state

    def save_state_until_full(path, **kw):
        real(path, **kw)
        Path(path, "big.bin").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.acc, "save_state", save_state_until_full)
    trainer.step = 3
    line = one_line(capsys, trainer.save_checkpoint)
    assert line.startswith(f"error: disk full (ENOSPC) while writing checkpoint {tmp_path / 'checkpoint-3'} (")
    assert "the partial copy was removed and the previous checkpoints are intact" in line
    assert partials(tmp_path) == [] and not (tmp_path / "checkpoint-3").exists()
    intact(tmp_path / "checkpoint-2")


def test_final_weights(tmp_path, capsys):
    trainer = trained(tmp_path)

    def save_until_full(path):
        Path(path, "model.safetensors").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    line = one_line(capsys, lambda: finish_run(trainer.acc, trainer.cfg, {"steps": 2}, save_until_full))
    assert f"disk full (ENOSPC) while writing the final weights {tmp_path / 'final'}" in line
    assert partials(tmp_path) == [] and not (tmp_path / "final").exists()
    intact(tmp_path / "checkpoint-2")


@pytest.mark.parametrize("stem,what", [("summary", "the summary"), ("reward_curve", "the curves")])
def test_summary_and_curves(tmp_path, capsys, disk_full_for, stem, what):
    trainer = make(tmp_path, max_steps=2, save_steps=1)
    if stem == "summary":
        trainer.train()
        disk_full_for(stem)
        run = lambda: finish_run(trainer.acc, trainer.cfg, {"steps": 2}, trainer.policy.save)  # noqa: E731
        name = "summary.json"
    else:
        disk_full_for(stem)
        run, name = trainer.train, "reward_curve.png"
    line = one_line(capsys, run)
    assert f"disk full (ENOSPC) while writing {what} {tmp_path / name}" in line
    assert partials(tmp_path) == [] and not (tmp_path / name).exists()
    intact(tmp_path / "checkpoint-2")


class Samples:
    """An evaluator whose every evaluation writes two sample rows."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __call__(self):
        self.trainer._record_eval({"eval/x": 1.0}, samples=[{"prompt": "p", "completion": "c" * 50, "x": 1.0}] * 2)
        return {"eval/x": 1.0}


@pytest.mark.parametrize("when", ["first write", "append"])
def test_completions_table(tmp_path, monkeypatch, capsys, disk_full_for, when):
    trainer = make(tmp_path, max_steps=2, save_steps=1)
    trainer.evaluate = Samples(trainer)
    path = tmp_path / "completions.jsonl"
    if when == "first write":
        disk_full_for("completions")
        line = one_line(capsys, trainer.evaluate)
        assert not path.exists()
    else:
        trainer.evaluate()
        trainer.train()  # step 2's rows appended
        before = path.read_bytes()
        monkeypatch.setattr("unialign.files.os", full_disk_os(7))  # its write runs out of space half-way
        trainer.step = 3
        line = one_line(capsys, trainer.evaluate)
        assert path.read_bytes() == before  # cut back: no half line
    assert f"disk full (ENOSPC) while writing the sample table {path}" in line
    assert partials(tmp_path) == []


def test_comparison_image(tmp_path, capsys, disk_full_for):
    from unialign.image.grid import save_comparison

    images = [Image.new("RGB", (16, 16), (i * 40, 0, 0)) for i in range(2)]
    disk_full_for("comparison")
    path = tmp_path / "comparison.png"
    line = one_line(capsys, lambda: save_comparison(path, images, images, ["a", "b"]))
    assert f"disk full (ENOSPC) while writing the comparison image {path}" in line
    assert partials(tmp_path) == [] and not path.exists()


def test_reference_cache(tmp_path, monkeypatch, capsys):
    import safetensors.torch

    from unialign.trainers.preference import _write_reference_cache

    def save_file_until_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"x" * 64)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file_until_full)
    path = tmp_path / "reference_logps.safetensors"
    line = one_line(capsys, lambda: _write_reference_cache(path, {0: (1.0, 2.0)}))
    assert f"disk full (ENOSPC) while writing the reference log-prob cache {path}" in line
    assert partials(tmp_path) == [] and not path.exists()


def test_run_record_and_the_lock(tmp_path, monkeypatch, capsys, disk_full_for):
    disk_full_for("run")
    line = one_line(capsys, lambda: rundir.claim(tmp_path, False, False))
    assert f"disk full (ENOSPC) while writing the run record {tmp_path / 'run.json'}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no lock left behind, no debris
    assert rundir.claimed(tmp_path) is None
    monkeypatch.undo()  # space again
    rundir.claim(tmp_path, False, False)  # the lock was given back: the next try takes it
    rundir.release(tmp_path)


def test_tracker_logs(tmp_path, monkeypatch, capsys):
    trainer = make(tmp_path, max_steps=3, save_steps=1, report_to="tensorboard")
    calls = []
    real = trainer.acc.log

    def log_until_full(values, step=None, **kw):  # TensorBoard's writer thread re-raises its error at the next call
        calls.append(step)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "logs" / "events.out.tfevents.1"))
        return real(values, step=step, **kw)

    monkeypatch.setattr(trainer.acc, "log", log_until_full)
    line = one_line(capsys, trainer.train)
    assert f"disk full (ENOSPC) while writing the tracker logs in {tmp_path / 'logs'}" in line
    intact(list_checkpoints(tmp_path)[-1])


def test_an_unwrapped_full_disk_is_still_one_line(capsys):
    def deep_library_write():
        raise OSError(errno.EDQUOT, "Disk quota exceeded", "/somewhere/file.bin")

    line = one_line(capsys, deep_library_write)
    assert line == ("error: disk quota exceeded (EDQUOT) while writing /somewhere/file.bin: free some space, then "
                    "--resume_from_checkpoint latest")


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path, "2m") as mount:
        yield mount


@pytest.mark.slow
def test_a_real_disk_that_fills_during_the_first_evaluation(small_disk):
    """grpo_math.py on a 2 MB file system with 8 KB left (two 4 KB pages: the lock and run.json): the held-out evaluation's sample table does not fit.
    One line naming the file, exit 2, no partial file."""
    out = small_disk / "run"
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - 8 * 1024))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "scripts" / "grpo_math.py"), "--output_dir", str(out),
                           "--max_steps", "2", "--report_to", "none"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last.startswith(f"error: disk full (ENOSPC) while writing the sample table {out / 'completions.jsonl'} (")
    assert "Traceback" not in proc.stderr
    assert partials(small_disk) == [] and not (out / "completions.jsonl").exists()
    assert not (out / rundir.LOCK_FILE).exists()


# ------------------------------------------------------------------ nothing a person left is lost
def test_a_run_deletes_and_absorbs_none_of_a_persons_files(tmp_path):
    """Names the old writer used for its temporary and replaced copies are a person's files now: kept as they are."""
    theirs = {"final.old/a.txt": "keep", "checkpoint-2.old/b.txt": "keep", ".tmp-final/c.txt": "keep",
              ".tmp-checkpoint-1/d.txt": "keep", "summary.json.tmp": "keep", "completions.jsonl.tmp": "keep"}
    for rel, text in theirs.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    trainer = make(tmp_path, max_steps=2, save_steps=1)
    trainer.evaluate = Samples(trainer)
    trainer.evaluate()
    trainer.train()
    finish_run(trainer.acc, trainer.cfg, {"steps": 2}, trainer.policy.save)
    for rel, text in theirs.items():
        assert (tmp_path / rel).read_text() == text, rel
    assert sorted(p.name for p in (tmp_path / "checkpoint-1").iterdir()) == sorted(
        p.name for p in (tmp_path / "checkpoint-2").iterdir())  # nothing of .tmp-checkpoint-1 absorbed
    # and again when the same folder is taken over: only the previous run's own outputs move
    second = make(tmp_path, max_steps=1, overwrite_output_dir=True)
    second.train()
    for rel, text in theirs.items():
        assert (tmp_path / rel).read_text() == text, rel


def test_debris_of_a_killed_save_of_this_run_is_removed_on_resume(tmp_path):
    trainer = trained(tmp_path)
    run_id = trainer.run.run_id
    rundir.release(tmp_path)
    debris = [tmp_path / f".checkpoint-3.partial-{run_id}", tmp_path / f".final.partial-{run_id}",
              partial_name(tmp_path / "summary.json", token="999999999-abcdef12")]  # a dead pid's
    for d in debris[:2]:
        d.mkdir()
        (d / "half.bin").write_bytes(b"x")
    debris[2].write_text("{")
    other = tmp_path / ".checkpoint-9.partial-0123456789abcdef"  # another run's: not this run's to remove
    other.mkdir()
    resumed = make(tmp_path, max_steps=3, save_steps=1, resume_from_checkpoint="latest")
    assert not any(d.exists() for d in debris) and other.exists()
    resumed.train()


def test_append_text_cuts_a_failed_write_back(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    append_text(path, "one\n")
    monkeypatch.setattr("unialign.files.os", full_disk_os(3))
    with pytest.raises(DiskFullError):
        append_text(path, "two\n")
    assert path.read_text() == "one\n"


def test_a_reader_never_sees_half_a_replaced_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_text(path, "old")

    def failing_replace(src, dst):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr("unialign.files.os.replace", failing_replace)
    with pytest.raises(OSError):
        write_text(path, "new")
    assert path.read_text() == "old" and partials(tmp_path) == []


# ------------------------------------------------------------------ links are never followed
def _outside(tmp_path) -> Path:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious.txt").write_text("keep")
    return target


@pytest.mark.parametrize("name", ["final", "checkpoint-2", "summary.json", "logs"])
@pytest.mark.parametrize("kind", ["outside", "dangling", "loop"])
def test_a_link_among_the_runs_own_names_is_refused_at_start(tmp_path, capsys, name, kind):
    out = tmp_path / "out"
    out.mkdir()
    target = {"outside": _outside(tmp_path), "dangling": tmp_path / "gone", "loop": out / name}[kind]
    (out / name).symlink_to(target)
    line = one_line(capsys, lambda: make(out))
    assert line.startswith(f"error: --output_dir: {out / name} is a symbolic link (-> {target}); a run replaces")
    assert (out / name).is_symlink()
    if kind == "outside":
        assert (target / "precious.txt").read_text() == "keep"


def test_a_final_link_made_during_the_run_is_refused_not_deleted(tmp_path, capsys):
    target = _outside(tmp_path)
    out = tmp_path / "out"
    trainer = make(out, max_steps=1)
    trainer.train()
    (out / "final").symlink_to(target)  # a tool made it while training
    line = one_line(capsys, lambda: finish_run(trainer.acc, trainer.cfg, {"steps": 1}, trainer.policy.save))
    assert line.startswith(f"error: {out / 'final'}: is a symbolic link (-> {target})")
    assert (out / "final").is_symlink() and (target / "precious.txt").read_text() == "keep"
    assert partials(out) == []


def test_a_checkpoint_link_made_during_the_run_is_never_rotated_through(tmp_path):
    target = _outside(tmp_path)
    out = tmp_path / "out"
    trainer = make(out, max_steps=3, save_steps=1, save_total_limit=1)
    (out / "checkpoint-0").symlink_to(target)  # not named at start; listed nowhere, deleted never
    trainer.train()
    assert (target / "precious.txt").read_text() == "keep" and (out / "checkpoint-0").is_symlink()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"]


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_an_output_dir_that_is_a_broken_link_is_one_line(tmp_path, capsys, kind):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere" if kind == "dangling" else out)
    line = one_line(capsys, lambda: make(out))
    why = "points to nothing" if kind == "dangling" else "loops"
    assert line.startswith(f"error: --output_dir: {str(out)!r} is a symbolic link that {why}")


def test_a_broken_link_on_the_output_dirs_path_is_named(tmp_path, capsys):
    (tmp_path / "outputs").symlink_to(tmp_path / "unmounted")
    line = one_line(capsys, lambda: make(tmp_path / "outputs" / "run"))
    assert line.startswith(f"error: --output_dir: {str(tmp_path / 'outputs' / 'run')!r}: {tmp_path / 'outputs'} is a "
                           "symbolic link that points to nothing")


def test_an_output_dir_reached_through_a_link_is_written_through(tmp_path):
    real = tmp_path / "big_disk"
    real.mkdir()
    (tmp_path / "outputs").symlink_to(real)
    trainer = make(tmp_path / "outputs" / "run", max_steps=1)
    trainer.train()
    finish_run(trainer.acc, trainer.cfg, {"steps": 1}, trainer.policy.save)
    assert (real / "run" / "final").is_dir() and (real / "run" / "summary.json").is_file()


def test_replace_dir_refuses_a_link(tmp_path):
    from unialign.files import replace_dir

    target = _outside(tmp_path)
    (tmp_path / "final").symlink_to(target)
    new = tmp_path / "new"
    new.mkdir()
    with pytest.raises(LinkError):
        replace_dir(new, tmp_path / "final")
    assert new.is_dir() and (target / "precious.txt").exists()


def test_json_safe_reads_tensors_without_importing_torch_itself():
    from unialign.files import json_safe

    assert json_safe({"t": torch.tensor(2.5), "n": float("nan")}) == {"t": 2.5, "n": None}
    assert "import torch" not in (Path(__file__).resolve().parents[2] / "unialign" / "files.py").read_text()


# ------------------------------------------------------------------ no writer outside the policy
# (module, function) -> why it may write directly: the only places a file is written without unialign.files
DIRECT_WRITES = {
    ("unialign/files.py", "write_bytes"): "the policy itself",
    ("unialign/files.py", "write_text"): "the policy itself",
    ("unialign/files.py", "write_json"): "the policy itself",
    ("unialign/trainers/loop.py", "_write_samples"): "unialign.files.write_text (imported by name)",
    ("unialign/trainers/outputs.py", "_save_figure"): "inside write_with's writer",
    ("unialign/trainers/outputs.py", "_save_final"): "into the temporary folder _save_final renames into place",
    ("unialign/trainers/checkpoint.py", "save_checkpoint"): "into the checkpoint's temporary folder",
    ("unialign/trainers/preference.py", "_write_reference_cache"): "inside write_with's writer",
    ("unialign/text/policy.py", "save"): "a policy's save: into the folder finish_run / save_checkpoint gives it",
    ("unialign/text/reward_model.py", "save"): "the same",
    ("unialign/vision/policy.py", "save"): "the same",
    ("unialign/dlm/policy.py", "save"): "the same",
    ("unialign/image/denoiser.py", "save"): "the same",
    ("unialign/trl.py", "save_model"): "TRL's save_model: into the folder the user names, under writing()",
    ("unialign/text/vllm_engine.py", "_model_dir_for_engine"): "a private temporary folder the engine reads",
    ("unialign/image/data.py", "_png"): "into memory (BytesIO)",
    ("unialign/rewards/image.py", "jpeg_size_kb"): "into memory (BytesIO)",
    ("unialign/embedded/vlm.py", "export"): "a command that exports a data set, not a run",
    ("unialign/embedded/shapes_world.py", "write_tokenizer"): "the asset builder's, not a run's",
}


def test_every_file_a_run_writes_goes_through_the_write_policy():
    """A new direct write (``write_text``, ``open(..., "w")``, ``save``, ``savefig``, ``save_file``,
    ``save_pretrained``) anywhere in the package must be one of the known places above, or use unialign.files."""
    import ast

    root = Path(__file__).resolve().parents[2]
    names = {"write_text", "write_bytes", "savefig", "save_pretrained", "save_file", "save"}
    found = set()
    for path in sorted((root / "unialign").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                modes = [a.value for a in node.args[1:2] + [k.value for k in node.keywords if k.arg == "mode"]
                         if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if name in names or (name == "open" and any(set(m) & set("wax") for m in modes)):
                    found.add((rel, fn.name))
    unknown = sorted(found - set(DIRECT_WRITES))
    assert not unknown, f"files written outside unialign.files' write policy: {unknown}"
    assert not set(DIRECT_WRITES) - found, "an entry above no longer writes: remove it"
