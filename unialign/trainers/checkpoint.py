"""Checkpoints: written whole or not at all (``unialign.files``' folder policy), every file's sha256 recorded and
checked before a resume reads anything, plain JSON and safetensors for the loop's own state (nothing unpickled),
rotation of this run's own checkpoints only, and every random state the training draws from."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import numbers
import pickle
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from unialign.files import fsync_tree, json_safe, refuse_link, replace_dir, temp_dir, writing
from unialign.trainers.rundir import (
    CHECKPOINT_PREFIX,
    STATE_FILE,
    checkpoint_step,
    list_checkpoints,
    owner_run_id,
)
from unialign.trainers.rundir import state_file as _state_file

CHECKSUM_FILE = "checksums.json"  # sha256 of every other file of the checkpoint, checked before a resume uses it
CHECKPOINT_FORMAT = 2  # 2: run_id and checksums.json; older checkpoints are refused until sealed (``seal``)
# files a resume may read (accelerate's weights, optimizer, scheduler and RNG files; the loop's JSON and safetensors):
# each must be in checksums.json; other files (a person's notes) may sit in a checkpoint unlisted
LOADED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl", ".json", ".npy", ".npz")
RUN_ID_RE = re.compile(r"[0-9a-f]{16}")  # what rundir.claim makes; a run id names files and folders


def find_checkpoint(output_dir: str | Path, which: str, required: bool = True, max_steps: int | None = None,
                    verbose: bool = True) -> Path | None:
    """``which`` is a checkpoint path or ``"latest"``: the newest good checkpoint of the run ``output_dir`` belongs
    to (``run.json``; every valid one in a directory from before run ids). Each candidate is verified
    (``verify_checkpoint``: trainer state, step, checksums); a damaged explicit path is a ValueError naming the file,
    a damaged ``latest`` falls back to the previous good one, saying so on stderr. No checkpoint for ``latest`` is
    a ValueError (``required=False``: None)."""
    if which != "latest":
        path = Path(which)
        if not _state_file(path):
            raise ValueError(f"resume_from_checkpoint={which!r}: no {STATE_FILE} in that directory "
                             "(not a unialign checkpoint)")
        verify_checkpoint(path, max_steps)
        return path
    # the owner's checkpoints, and any from before run ids (there only when the owner resumed one of them)
    ckpts = list_checkpoints(output_dir, owner_run_id(output_dir), legacy=True)
    problems = []
    for path in reversed(ckpts):
        try:
            verify_checkpoint(path, max_steps)
        except ValueError as err:
            problems.append(str(err))
            continue
        if problems and verbose:
            print(f"warning: resuming {path.name}, the newest good checkpoint; skipped: {'; '.join(problems)}",
                  file=sys.stderr)
        return path
    if required and problems:
        raise ValueError(f"resume_from_checkpoint='latest': no good checkpoint in output_dir={str(output_dir)!r}; "
                         f"{'; '.join(problems)}")
    if required:
        raise ValueError(f"resume_from_checkpoint='latest': no checkpoint to resume in output_dir={str(output_dir)!r} "
                         f"(no {CHECKPOINT_PREFIX}<step> folder with a {STATE_FILE}); drop the flag to start from "
                         "step 0")
    return None


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` but ``CHECKSUM_FILE``, by path relative to ``root`` (POSIX form)."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        out[path.relative_to(root).as_posix()] = h.hexdigest()
    return out


_VERIFIED: dict[tuple, dict] = {}  # (checkpoint, its files' sizes and mtimes) -> state: each version hashed once


def verify_checkpoint(ckpt: str | Path, max_steps: int | None = None) -> dict:
    """Check checkpoint ``ckpt`` before anything is loaded from it and return its trainer state: the state is
    plain data of the right types (``read_trainer_state``) whose step matches the folder name and, when given, is
    at most ``max_steps``; every file listed in ``checksums.json`` is present with its recorded sha256, and every
    file a resume reads (``LOADED_SUFFIXES``) is listed. A checkpoint without ``checksums.json`` is refused (one
    from before checksums were recorded can be sealed by hand: ``seal``). A ValueError names the file."""
    ckpt = Path(ckpt)
    state = read_trainer_state(ckpt)
    named = checkpoint_step(ckpt)
    if named is not None and named != state["step"]:
        raise ValueError(f"{ckpt / STATE_FILE}: step {state['step']} does not match the folder's step {named}; "
                         "the checkpoint is damaged or edited")
    if max_steps is not None and state["step"] > max_steps:
        raise ValueError(f"{ckpt}: the checkpoint is at step {state['step']}, past --max_steps {max_steps}; raise "
                         "--max_steps to continue it")
    sums = ckpt / CHECKSUM_FILE
    if not sums.is_file():
        old = state.get("checkpoint_format") is None and state.get("run_id") is None
        raise ValueError(f"{sums}: missing; the checkpoint is damaged" + (
            " or was written before checksums were recorded: if you trust its files, record them with `python -m "
            f"unialign.trainers.checkpoint seal {ckpt}`" if old else ""))
    key = (str(ckpt.resolve()), tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                                      for p in sorted(ckpt.rglob("*")) if p.is_file()))
    if key in _VERIFIED:
        return state
    try:
        recorded = json.loads(sums.read_text())["files"]
        assert isinstance(recorded, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise ValueError(f"{sums}: unreadable; the checkpoint is damaged") from None
    actual = file_digests(ckpt)
    unrecorded = sorted(n for n in actual if n not in recorded and (Path(n).suffix in LOADED_SUFFIXES or n == STATE_FILE))
    if unrecorded:  # an emptied or shortened list must not let a file a resume reads go unchecked
        raise ValueError(f"{ckpt / unrecorded[0]}: not in {CHECKSUM_FILE} (a file a resume reads, unverified); the "
                         "checkpoint is damaged or edited")
    for name, digest in recorded.items():
        if name not in actual:
            raise ValueError(f"{ckpt / name}: missing; the checkpoint is damaged")
        if actual[name] != digest:
            raise ValueError(f"{ckpt / name}: checksum mismatch (the file changed after it was written: truncated, "
                             "corrupted or edited); the checkpoint is damaged")
    _VERIFIED[key] = state
    return state


def read_trainer_state(ckpt: str | Path) -> dict:
    """The loop's own state of checkpoint ``ckpt``: ``trainer_state.json``, or an older checkpoint's
    ``trainer_state.pt`` read with ``torch.load(weights_only=True)``, so a crafted file cannot run code
    (it is refused with a ValueError instead). The fields the loop reads are checked for their types."""
    ckpt = Path(ckpt)
    path = _state_file(ckpt)
    if path is None:
        raise ValueError(f"{ckpt}: no {STATE_FILE} (not a unialign checkpoint)")
    if path.name == STATE_FILE:
        try:
            state = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise ValueError(f"{path}: not valid JSON ({type(err).__name__}: {str(err)[:100]}); the checkpoint is "
                             "damaged") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"{path}: refusing to load it: it holds more than plain data, and unpickling it "
                             f"could run code ({first})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path}: not a trainer state (expected a dict with a 'step')")
    for name, kind in (("step", int), ("cursor", int), ("history", list), ("counters", dict)):
        value = state.get(name, 0 if kind is int else kind())
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            raise ValueError(f"{path}: {name!r} is {value!r}, not a{'' if kind is int else ' JSON'} "
                             f"{'non-negative integer' if kind is int else kind.__name__}; the checkpoint is damaged")
    run_id = state.get("run_id")
    if run_id is not None and not (isinstance(run_id, str) and RUN_ID_RE.fullmatch(run_id)):
        raise ValueError(f"{path}: 'run_id' is {str(run_id)[:40]!r}, not a run id (16 hex digits); the checkpoint is "
                         "damaged or edited")
    return state


def prune_checkpoints(output_dir: str | Path, keep: int, run_id: str | None, legacy: bool = False) -> None:
    """Keep the newest ``keep`` checkpoints of run ``run_id`` under ``output_dir``, delete its older ones. Only
    that run's own checkpoints are touched (with ``legacy``, also those without a run id: the run resumed one of
    them): a folder another run (or a person) wrote is never deleted; with no ``run_id`` nothing is."""
    if run_id is None or keep <= 0:
        return
    for path in list_checkpoints(output_dir, run_id, legacy)[:-keep]:
        if not path.is_symlink():  # list_checkpoints lists no links; one made since is never followed
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.ERROR):
    """``name``'s log records below ``level`` dropped for the block: accelerate's "Removed shared tensor ... while
    saving" warning on every checkpoint of a model with tied weights is expected (the checkpoint round-trips)."""
    log = logging.getLogger(name)
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)


def save_checkpoint(acc, output_dir: str | Path, step: int, state: dict, keep: int, run_id: str | None = None,
                    random_states: dict[str, torch.Tensor] | None = None, legacy: bool = False,
                    state_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """accelerate state (model, optimizer, scheduler, global RNGs) + the loop's own ``state`` dict (as
    ``trainer_state.json``: plain JSON, NaN kept as JSON's NaN extension, which Python reads back
    exactly, with ``run_id``) + ``random_states`` (the policies' own generators, a safetensors file) +
    ``checksums.json`` (sha256 of every file), written to a temporary directory and renamed into
    ``checkpoint-<step>`` only once complete; then this run's older checkpoints are pruned to ``keep``. A write
    that fails (a full disk: ``DiskFullError``, one line naming the path) removes the temporary directory and
    leaves the previous checkpoints as they were."""
    out = Path(output_dir)
    final = out / f"{CHECKPOINT_PREFIX}{step}"
    what = f"checkpoint {final}"
    tmp = None
    if acc.is_main_process:
        refuse_link(final, what)
        if final.exists() and final not in list_checkpoints(out, run_id, legacy):
            raise ValueError(f"{final}: exists and was not written by this run; refusing to replace it (move it "
                             "away, then --resume_from_checkpoint latest)")
        tmp = temp_dir(final, run_id if run_id and RUN_ID_RE.fullmatch(run_id) else None)
    tmp = Path(agreed(acc, None if tmp is None else str(tmp)))  # every process writes its part into the same folder
    with writing(tmp if acc.is_main_process else None, what), quiet_logger("accelerate.utils.other"):
        acc.save_state(str(tmp))  # tied weights (an LM's shared embeddings) are saved once, as they should be
        acc.wait_for_everyone()  # every process's files are in before the checksums are taken
        if acc.is_main_process:
            if random_states:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in random_states.items()}, str(tmp / RANDOM_STATES_FILE))
            if state_tensors:
                from safetensors.torch import save_file

                save_file({k: v.detach().cpu().contiguous() for k, v in state_tensors.items()},
                          str(tmp / STATE_TENSORS_FILE))
            (tmp / STATE_FILE).write_text(json.dumps(_plain({**state, "run_id": run_id,
                                                             "checkpoint_format": CHECKPOINT_FORMAT})))
            (tmp / CHECKSUM_FILE).write_text(json.dumps({"algorithm": "sha256", "files": file_digests(tmp)}, indent=0))
            fsync_tree(tmp)
            replace_dir(tmp, final, what)
            prune_checkpoints(out, keep, run_id, legacy)
    acc.wait_for_everyone()
    return final


RANDOM_STATES_FILE = "random_states.safetensors"  # the policies' own torch.Generator states, uint8 tensors
STATE_TENSORS_FILE = "state_tensors.safetensors"  # training state the policies hold beyond weights (an old policy)


def read_random_states(ckpt: str | Path, name: str = RANDOM_STATES_FILE) -> dict[str, torch.Tensor]:
    """The generator states (or, ``name=STATE_TENSORS_FILE``, the sources' state tensors) ``save_checkpoint``
    wrote (none for older checkpoints); safetensors, never a pickle."""
    path = Path(ckpt) / name
    if not path.is_file():
        return {}
    from safetensors.torch import load_file

    return load_file(str(path))


def source_state_tensors(sources: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every source's ``state_tensors()`` (e.g. a policy's old policy) as ``"<source>.<name>"``."""
    out = {}
    for prefix, obj in sources.items():
        own = getattr(obj, "state_tensors", None)
        if callable(own):
            out.update({f"{prefix}.{k}": v for k, v in own().items()})
    return out


def set_source_state_tensors(sources: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    for prefix, obj in sources.items():
        load = getattr(obj, "load_state_tensors", None)
        mine = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        if callable(load) and mine:
            load(mine)


def _plain(obj: Any) -> Any:
    """Like ``json_safe`` but keeping non-finite floats (a checkpoint must restore them exactly)."""
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        obj = obj.item()
    if isinstance(obj, numbers.Real) and not isinstance(obj, (bool, numbers.Integral)):
        return float(obj)
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return json_safe(obj)


def _generators(sources: dict[str, Any]) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` the ``sources`` own, as ``"<source>.<name>"``: each source's ``generators()``
    (a policy's sampling / noise generator, a reward's), for sources that have one."""
    out = {}
    for prefix, obj in sources.items():
        own = getattr(obj, "generators", None)
        if callable(own):
            for name, gen in own().items():
                out[f"{prefix}.{name}"] = gen
    return out


def generator_states(sources: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The states of the ``sources``' own generators (uint8 tensors), for ``save_checkpoint``."""
    return {name: gen.get_state() for name, gen in _generators(sources).items()}


def set_generator_states(sources: dict[str, Any], states: dict[str, torch.Tensor], where: Path | str) -> None:
    """Restore the ``sources``' generators from ``states``. A generator the checkpoint does not hold is left as it
    is when the checkpoint holds none at all (one written before generators were saved) and is an error
    otherwise (the policy changed)."""
    gens = _generators(sources)
    if not states:
        return
    missing = sorted(set(gens) - set(states))
    if missing:
        raise ValueError(f"{where}: holds no state for the generators {missing}; the policy is not the one that "
                         "wrote it")
    for name, gen in gens.items():
        gen.set_state(states[name])


@contextlib.contextmanager
def preserved_random_state(sources: dict[str, Any]):
    """Run the body without moving any random state the training draws from: torch's global RNGs (CPU, CUDA)
    and the ``sources``' own generators come back as they were. Evaluation between steps runs inside, so a run
    gives the same updates with or without ``eval_steps``, and a resume (which does not repeat an evaluation)
    continues exactly."""
    saved = {name: gen.get_state() for name, gen in _generators(sources).items()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for name, gen in _generators(sources).items():
                gen.set_state(saved[name])


def agreed(acc, value: Any) -> Any:
    """``value`` as the main process has it, on every process of the launch (a path one process chose)."""
    if acc.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def seal(ckpt: str | Path) -> Path:
    """Record the sha256 of every file of checkpoint ``ckpt`` in its ``checksums.json`` (for a checkpoint written
    before checksums were recorded, after you checked it is whole); its trainer state must read as one. Returns
    the checksum file."""
    ckpt = Path(ckpt)
    read_trainer_state(ckpt)
    from unialign.files import write_json

    return write_json(ckpt / CHECKSUM_FILE, {"algorithm": "sha256", "files": file_digests(ckpt)}, indent=0)


if __name__ == "__main__":  # python -m unialign.trainers.checkpoint seal <checkpoint folder>
    import argparse

    parser = argparse.ArgumentParser(prog="python -m unialign.trainers.checkpoint",
                                     description="seal: record the checksums of a checkpoint you trust")
    parser.add_argument("command", choices=["seal"])
    parser.add_argument("checkpoint")
    args = parser.parse_args()
    try:
        print(f"wrote {seal(args.checkpoint)}")
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
