"""Pieces every trainer loop shares: atomic checkpoints, safe and honest resume, run summaries and curves,
schedules."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import math
import numbers
import os
import pickle
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from unialign.config import OPTIMIZERS, REPORT_TO, SCHEDULERS, arg, check_output_dir, check_tracker
from unialign.errors import UserError
from unialign.trainers.rundir import (
    CHECKPOINT_PREFIX,
    LEGACY_STATE_FILE,  # noqa: F401 - re-exported: the names checkpoints were read by
    STATE_FILE,
    checkpoint_step,
    list_checkpoints,
    owner_run_id,
    release,
)
from unialign.trainers.rundir import state_file as _state_file


@dataclass
class TrainConfig:
    """Fields every loop shares: optimisation, schedule, seeding, logging and checkpoints."""

    max_steps: int = arg(100, "optimizer steps to train (>= 1)", group="optimisation", min=1)
    learning_rate: float = arg(1e-5, "peak learning rate (after warmup)", group="optimisation", min=0.0)
    weight_decay: float = arg(0.0, "decoupled weight decay", group="optimisation", min=0.0)
    adam_beta1: float = arg(0.9, "Adam beta1", group="optimisation", min=0.0, lt=1.0)
    adam_beta2: float = arg(0.999, "Adam beta2", group="optimisation", min=0.0, lt=1.0)
    adam_epsilon: float = arg(1e-8, "Adam epsilon", group="optimisation", gt=0.0)
    optim: str = arg("adamw_torch", "optimizer (TRL / transformers names); adamw_8bit needs bitsandbytes",
                     group="optimisation", choices=OPTIMIZERS)
    lr_scheduler_type: str = arg("constant", "learning-rate schedule after warmup", group="optimisation",
                                 choices=SCHEDULERS)
    warmup_steps: int = arg(0, "linear warmup steps", group="optimisation", min=0)
    max_grad_norm: float = arg(1.0, "clip the gradient norm to this", group="optimisation", gt=0.0)
    seed: int = arg(0, "seed of sampling, data order and initialisation", group="optimisation")
    num_threads: int | None = arg(
        None, "torch intra-op CPU threads (tiny models run fastest on 1; <= 0: torch's choice)", group="model")
    output_dir: str = arg("outputs/run", "folder for checkpoints, logs, curves, summary.json and final/",
                          group="logging")
    logging_steps: int = arg(1, "log metrics to the trackers every N steps", group="logging", min=1)
    save_steps: int = arg(0, "save a checkpoint every N steps (0: only at the end, and every --save_minutes)",
                          group="logging", min=0)
    save_minutes: float = arg(
        5.0, "also save a checkpoint when this many minutes of wall-clock passed since the last one (0: off), so a "
             "killed run loses at most that much; SIGTERM / Ctrl-C save one after the current step either way",
        group="logging", min=0.0)
    save_total_limit: int = arg(2, "keep at most this many checkpoints", group="logging", min=0)
    report_to: str = arg("tensorboard", "experiment tracker ('none': no tracker)", group="logging", choices=REPORT_TO)
    resume_from_checkpoint: str | None = arg(None, "a checkpoint folder, or 'latest' (the newest under "
                                             "output_dir; an error when there is none)", group="logging")
    overwrite_output_dir: bool = arg(
        False, "start a fresh run in an output_dir that holds another run's outputs (that run's checkpoints are left "
               "in place and no longer resumed by 'latest'; final/ and summary.json are replaced)", group="logging")
    allow_config_change: bool = arg(False, "resume even when the learning rate / schedule, algorithm, batch "
                                    "shape, model or data differ from the checkpoint's; the new values "
                                    "apply and summary.json records both", group="optimisation")

    def check(self) -> None:
        """The checks of fields together (``unialign.config.validate`` runs them once every field passed its own
        rules): the tracker's package is installed, ``output_dir`` is a writable directory this run may use (a
        fresh run does not mix with another run's outputs unless ``overwrite_output_dir``), and a resume finds its
        checkpoint, whole."""
        from unialign.trainers import rundir

        check_tracker(self.report_to)
        if not str(self.output_dir).strip():
            rundir.check(self.output_dir, False, False)  # the one line for an empty name
        check_output_dir(self.output_dir)
        rundir.check(self.output_dir, bool(self.resume_from_checkpoint), bool(self.overwrite_output_dir))
        if self.resume_from_checkpoint:  # "latest" with nothing to resume, or a damaged checkpoint: say so now
            try:
                find_checkpoint(self.output_dir, self.resume_from_checkpoint, max_steps=self.max_steps)
            except ValueError as err:
                raise UserError(str(err)) from None


def make_optimizer(params, cfg: TrainConfig):
    """The optimizer named by ``cfg.optim`` and its learning-rate schedule: a ``LambdaLR`` whose multiplier is
    ``lr_lambda(cfg.lr_scheduler_type, cfg.warmup_steps, cfg.max_steps)`` (transformers' schedules).

    adamw_torch: ``torch.optim.AdamW``. adafactor: ``torch.optim.Adafactor`` with the given learning rate
    (factored second moments, no first moment: optimizer state ~O(rows + cols) per matrix).
    adamw_8bit: bitsandbytes' ``AdamW8bit`` (8-bit moments; needs ``pip install bitsandbytes`` and,
    in practice, a GPU)."""
    if cfg.optim == "adamw_torch":
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                      betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    elif cfg.optim == "adafactor":  # clip threshold d = 1, a fixed lr: DiffusionDPO's SDXL settings
        optimizer = torch.optim.Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    elif cfg.optim == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("optim='adamw_8bit' needs bitsandbytes: pip install bitsandbytes "
                             "(or use optim='adafactor')") from None
        optimizer = bnb.optim.AdamW8bit(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                        betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    else:
        raise ValueError(f"optim: unknown optimizer {cfg.optim!r}; choose one of {', '.join(OPTIMIZERS)}")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.lr_scheduler_type, cfg.warmup_steps, cfg.max_steps))
    return optimizer, scheduler


def epoch_order(cursor: int, n: int, count: int, seed: int) -> list[int]:
    """Row indices ``cursor .. cursor + count`` of an endless stream of epochs, each a permutation of
    ``range(n)`` seeded by (seed, epoch): the same on every process and after a resume."""
    out = []
    for c in range(cursor, cursor + count):
        epoch, pos = divmod(c, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch))
        out.append(int(perm[pos]))
    return out


def atomic_replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a fully written ``tmp_dir`` to ``final_dir`` so that a crash never leaves a half checkpoint:
    the old directory (if any) is moved aside first and deleted only after the rename."""
    old = final_dir.with_name(final_dir.name + ".old")
    if final_dir.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old.exists():
        shutil.rmtree(old)


def json_safe(obj: Any) -> Any:
    """``obj`` as strict JSON data: NaN / +-inf -> None, numpy and one-element tensor scalars -> numbers,
    tuples -> lists, paths and other objects -> ``str``; dict keys become strings."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        obj = obj.item()
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if type(obj).__module__.startswith("PIL.") and hasattr(obj, "size"):  # an image in a prompt: its size, not a repr
        return f"<image {obj.size[0]}x{obj.size[1]}>"
    return str(obj)


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write ``data`` as strict JSON (``json_safe``: NaN / Infinity become null) through a temporary file
    renamed into place, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(data), indent=2, allow_nan=False))
    os.replace(tmp, path)


def finish_run(acc, cfg, summary: dict, save, counters: dict[str, int] | None = None) -> dict:
    """End of a script: ``save(<output_dir>/final)`` on every process (stock-loadable weights, written by the
    main process into a temporary folder renamed into place, so ``final/`` is never half written), then on the
    main process write ``summary.json`` (strict JSON) with the run's config added, the trainer's non-zero
    ``counters`` (samples whose reward errored and were skipped, non-finite rewards, skipped steps), and the
    settings a resume changed (``config_changes_on_resume``, from the run's last checkpoint) when there were any;
    print where the outputs are and the summary as JSON, and release the run's hold on the directory.
    Returns the summary."""
    summary.update({k: v for k, v in (counters or {}).items() if v})  # e.g. reward_errors skipped, nonfinite rewards
    summary["config"] = {k: v for k, v in asdict(cfg).items() if v is not None}
    if callable(getattr(cfg, "algo_spec", None)):  # the algorithm as run: preset + overrides, every knob resolved
        summary["algorithm_spec"] = asdict(cfg.algo_spec())
    out = Path(cfg.output_dir)
    ckpt = find_checkpoint(out, "latest", required=False, verbose=False)
    changes = read_trainer_state(ckpt).get("config_changes") if ckpt is not None else None
    if changes:
        summary["config_changes_on_resume"] = changes
    tmp = out / ".tmp-final"
    with writing(tmp, f"the final weights {out / 'final'}"):
        if acc.is_main_process and tmp.exists():
            shutil.rmtree(tmp)  # debris of a run killed while saving
        acc.wait_for_everyone()
        save(str(tmp))  # on every process: a sharded model is gathered; the main process writes
        acc.wait_for_everyone()
        if acc.is_main_process and tmp.exists():  # a saver may write nothing (tests, a frozen policy)
            atomic_replace_dir(tmp, out / "final")
    if acc.is_main_process:
        with writing(out / "summary.json.tmp", f"{out / 'summary.json'}"):
            write_json_atomic(out / "summary.json", summary)
        print_summary(acc, out, summary)
    release(out)
    return summary


def print_summary(acc, output_dir: str | Path, summary: dict) -> None:
    """Print the output folder and the summary (without its config and algorithm spec) as JSON, on the main process."""
    shown = json_safe({k: v for k, v in summary.items() if k not in ("config", "algorithm_spec")})
    acc.print(f"outputs in {Path(output_dir).resolve()} (final/ weights, summary.json, curves, checkpoints)")
    acc.print(json.dumps(shown, indent=1))


CHECKSUM_FILE = "checksums.json"  # sha256 of every other file of the checkpoint, checked before a resume uses it
CHECKPOINT_FORMAT = 2  # 2: run_id and checksums.json; older checkpoints (no format) are read unverified


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
    at most ``max_steps``; every file listed in ``checksums.json`` is present with its recorded sha256 (a checkpoint
    of format 2 without that file is damaged; older ones are read unverified). A ValueError names the file."""
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
        if state.get("checkpoint_format", 1) >= CHECKPOINT_FORMAT:
            raise ValueError(f"{sums}: missing; the checkpoint is damaged")
        return state
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
    return state


def data_fingerprint(rows: list[Any]) -> str:
    """A short hash of the training rows (their values, keys sorted; images and tensors by their bytes):
    the same rows give the same fingerprint on every run and machine."""
    h = hashlib.sha256()
    _hash_into(h, rows)
    return h.hexdigest()[:16]


def _hash_into(h, obj: Any) -> None:
    if isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=str):
            _hash_into(h, str(k))
            _hash_into(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[%d" % len(obj))
        for v in obj:
            _hash_into(h, v)
    elif isinstance(obj, (bytes, bytearray)):
        h.update(b"b%d:" % len(obj) + bytes(obj))
    elif obj is None or isinstance(obj, (bool, numbers.Number, str)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor{tuple(t.shape)}{t.dtype};".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif hasattr(obj, "tobytes") and hasattr(obj, "mode") and hasattr(obj, "size"):  # PIL image
        h.update(f"image{obj.mode}{tuple(obj.size)};".encode() + obj.tobytes())
    elif hasattr(obj, "tobytes") and hasattr(obj, "dtype"):  # numpy array
        h.update(f"array{getattr(obj, 'shape', ())}{obj.dtype};".encode() + obj.tobytes())
    else:
        h.update(f"{type(obj).__name__}:{obj!s};".encode())


def resume_settings(cfg: TrainConfig, rows: list[Any], **extra: Any) -> dict[str, Any]:
    """What a resume must not change silently, as JSON data: optimiser and learning-rate schedule
    (``max_steps`` only where the schedule depends on it), seed (the data order), the model
    (``model_name_or_path`` when the config has one), ``dataset_fingerprint`` of ``rows``, and the loop's
    own ``extra`` (algorithm and its knobs, batch shape)."""
    names = ["learning_rate", "lr_scheduler_type", "warmup_steps", "optim", "weight_decay", "adam_beta1",
             "adam_beta2", "adam_epsilon", "max_grad_norm", "seed"]
    if cfg.lr_scheduler_type != "constant":
        names.append("max_steps")
    settings = {n: getattr(cfg, n) for n in names}
    for name in ("model_name_or_path", "vae_name_or_path"):
        if hasattr(cfg, name):
            settings[name] = getattr(cfg, name)
    settings.update(extra)
    settings["dataset_fingerprint"] = data_fingerprint(rows)
    return json.loads(json.dumps(json_safe(settings)))


@dataclass
class ResumePoint:
    """A checkpoint accepted for resuming: its folder, the loop's state, and the settings that differ."""

    path: Path
    state: dict
    changes: list[dict]


def plan_resume(cfg: TrainConfig, settings: dict[str, Any]) -> ResumePoint | None:
    """Before training: find ``cfg.resume_from_checkpoint`` (None when not resuming), read its state
    safely and compare its settings with ``settings`` (``resume_settings``). A difference is a ValueError
    listing each field, checkpoint vs now, unless ``cfg.allow_config_change``; then the changes are
    appended to the state's ``config_changes`` (``{"step", "field", "old", "new"}`` each), which later
    checkpoints and ``summary.json`` carry. Nothing is loaded into the model here."""
    if not cfg.resume_from_checkpoint:
        return None
    path = find_checkpoint(cfg.output_dir, cfg.resume_from_checkpoint, max_steps=cfg.max_steps, verbose=False)
    state = verify_checkpoint(path, cfg.max_steps)
    old = state.get("settings")
    if old is None:  # a checkpoint from before settings were recorded: compare what its config holds
        old_cfg = state.get("config") or {}
        old = {k: old_cfg[k] for k in settings if k in old_cfg}
    fields = [k for k in settings if k in old and old[k] != settings[k]]
    changes = [{"step": state["step"], "field": k, "old": old.get(k), "new": settings[k]} for k in fields]
    if changes and not cfg.allow_config_change:
        lines = "\n".join(f"  {c['field']}: {c['old']!r} (checkpoint) -> {c['new']!r} (now)" for c in changes)
        raise ValueError(f"resume_from_checkpoint: {path} was trained with other settings:\n{lines}\n"
                         "pass --allow_config_change to resume with the new values anyway (summary.json then "
                         "records both), or use another --output_dir to start afresh")
    state["config_changes"] = list(state.get("config_changes") or []) + changes
    return ResumePoint(path, state, changes)


def apply_optimizer_settings(optimizer, scheduler, cfg: TrainConfig) -> None:
    """After loading a checkpoint whose settings were allowed to change: the config's learning rate,
    weight decay and Adam constants replace those the optimizer state carried, and the current lr is
    recomputed from the (new) schedule at the restored step, so the run trains with what it records."""
    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the LambdaLR
    scheduler.base_lrs = [cfg.learning_rate for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, [f(scheduler.last_epoch) for f in scheduler.lr_lambdas]):
        group["initial_lr"] = cfg.learning_rate
        group["lr"] = cfg.learning_rate * factor
        group["weight_decay"] = cfg.weight_decay
        if cfg.optim != "adafactor":
            group["betas"] = (cfg.adam_beta1, cfg.adam_beta2)
            group["eps"] = cfg.adam_epsilon
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def prune_checkpoints(output_dir: str | Path, keep: int, run_id: str | None, legacy: bool = False) -> None:
    """Keep the newest ``keep`` checkpoints of run ``run_id`` under ``output_dir``, delete its older ones. Only
    that run's own checkpoints are touched (with ``legacy``, also those without a run id: the run resumed one of
    them): a folder another run (or a person) wrote is never deleted; with no ``run_id`` nothing is."""
    if run_id is None or keep <= 0:
        return
    for path in list_checkpoints(output_dir, run_id, legacy)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


# our schedule names (unialign.config.SCHEDULERS) -> transformers' get_scheduler names; each warms up first
TRANSFORMERS_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at 0-based step ``s`` (the lr of the ``s + 1``-th optimizer step),
    for ``torch.optim.lr_scheduler.LambdaLR``: transformers' ``get_scheduler`` schedule ``kind`` (constant |
    linear | cosine) with ``w = warmup_steps`` linear warm-up steps over ``T = total_steps``:

    * warm-up, ``s < w``: ``(s + 1) / (w + 1)`` -- rises in equal steps to 1 at ``s = w``, never 0;
    * then constant ``1``; linear ``max(0, (T - s) / max(1, T - w))``; cosine
      ``0.5 * (1 + cos(pi * (s - w) / max(1, T - w)))`` -- both 0 at ``s = T``.

    transformers warms up as ``s / w`` instead (its first step has lr 0 and moves no weight), so this is its
    schedule for ``w + 1`` warm-up steps of ``T + 1``, read from its step 1 on: the same line without the lr-0
    step, and from ``s = w`` on transformers' own values for ``(w, T)``, bit for bit
    (``tests/test_library_parts.py``). The result is a ``functools.partial``, so a LambdaLR checkpoint holds
    its empty ``__dict__``, no code. Raises ValueError for another ``kind``."""
    if kind not in TRANSFORMERS_SCHEDULES:
        raise ValueError(f"lr_scheduler_type must be constant, linear or cosine, got {kind!r}")
    from transformers.optimization import get_scheduler  # modality-free: the schedules alone

    probe = torch.optim.SGD([torch.zeros(1)], lr=1.0)  # get_scheduler wants an optimizer; its lambda is kept
    (multiplier,) = get_scheduler(TRANSFORMERS_SCHEDULES[kind], probe, num_warmup_steps=warmup_steps + 1,
                                  num_training_steps=total_steps + 1).lr_lambdas
    return functools.partial(_one_step_on, multiplier)


def _one_step_on(multiplier: Callable[[int], float], step: int) -> float:
    return multiplier(step + 1)


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing moving average of ``values`` over ``window`` points (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def save_curves(history: list[dict], path: str | Path, keys: tuple[str, ...] = ("reward/mean",),
                smooth: tuple[str, ...] = ()) -> None:
    """Plot metrics over steps to a PNG (one panel per key present in the history, four to a row). Keys
    in ``smooth`` are drawn raw (faint) with a trailing moving average over ~5 % of the points on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def finite(key: str) -> list[tuple[int, float]]:
        return [(h["step"], float(h[key])) for h in history
                if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]

    keys = [k for k in keys if finite(k)]
    if not keys:
        return
    cols = min(len(keys), 4)
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, key in zip(axes.flat, keys):
        steps, values = zip(*finite(key))
        window = max(1, len(values) // 20)
        if key in smooth and window > 1:
            ax.plot(steps, values, color="C0", alpha=0.3, linewidth=0.8, label="raw")
            ax.plot(steps, smoothed(list(values), window), color="C0", label=f"mean of {window}")
            ax.legend(fontsize=8)
            ax.set_title(f"{key} (smoothed)")
        else:
            ax.plot(steps, values, marker="." if len(values) < 50 else None)
            ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def log_images(acc, images: dict[str, object], step: int) -> None:
    """Log PIL images / HWC uint8 arrays to the run's trackers that take images (TensorBoard, wandb);
    other trackers are skipped."""
    if not images:
        return
    import numpy as np

    for tracker in acc.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({k: np.asarray(v)[None] for k, v in images.items()}, step=step, dataformats="NHWC")
        elif hasattr(tracker, "log_images"):
            tracker.log_images({k: [v] for k, v in images.items()}, step=step)


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
    final, tmp = out / f"{CHECKPOINT_PREFIX}{step}", out / f".tmp-{CHECKPOINT_PREFIX}{step}"
    if acc.is_main_process and final.exists() and final not in list_checkpoints(out, run_id, legacy):
        raise ValueError(f"{final}: exists and was not written by this run; refusing to replace it (move it away, "
                         "then --resume_from_checkpoint latest)")
    with writing(tmp, f"checkpoint {final}"):
        acc.save_state(str(tmp))
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
            _fsync_tree(tmp)
            atomic_replace_dir(tmp, final)
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


class DiskFullError(ValueError):
    """A write ran out of space (ENOSPC); the message names the path and the space left."""


def _disk_full(err: BaseException, path: Path) -> bool:
    """True when ``err`` (or its cause) is ENOSPC / EDQUOT, or torch's serializer failed in a way a full disk
    produces (``unexpected pos``) while the file system has almost nothing left."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(err)
    if "No space left" in text or "unexpected pos" in text or "file write failed" in text:
        return _free_bytes(path) < 64 * 2**20
    return False


def _free_bytes(path: Path) -> int:
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return 0


@contextlib.contextmanager
def writing(tmp: Path, what: str):
    """Around writing ``what`` through the temporary path ``tmp``: on any failure ``tmp`` is removed (so a partial
    write never holds the space), and a full disk is re-raised as ``DiskFullError`` naming ``what``."""
    try:
        yield
    except BaseException as err:
        full = _disk_full(err, tmp)
        free = _free_bytes(tmp)
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if full:
            raise DiskFullError(f"disk full (ENOSPC) while writing {what} ({free / 2**20:.1f} MiB free on that file "
                                "system); the partial copy was removed and the previous checkpoints are intact: free "
                                "some space, then --resume_from_checkpoint latest") from None
        raise


def _fsync_tree(root: Path) -> None:
    """Flush every file of ``root`` to disk before it is renamed into place (a power loss must not leave a
    checkpoint whose files are named but empty)."""
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


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


def load_checkpoint(acc, resume: ResumePoint, optimizer=None, scheduler=None, cfg: TrainConfig | None = None) -> dict:
    """Restore accelerate state (weights, optimizer, scheduler, RNGs; accelerate reads them with
    ``weights_only=True``) from ``resume.path`` and return the loop's own state. When settings changed
    (allowed), ``apply_optimizer_settings`` makes the optimizer follow ``cfg``. A file that needs
    unpickling is refused with a ValueError naming the checkpoint."""
    try:
        acc.load_state(str(resume.path))
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{resume.path}: refusing to load a checkpoint file that holds more than plain data "
                         f"(unpickling it could run code): {first}") from None
    if resume.changes and optimizer is not None and cfg is not None:
        apply_optimizer_settings(optimizer, scheduler, cfg)
    return resume.state


def check_launch(acc: Any) -> None:
    """Refuse launches that would train wrongly without an error of their own:

    * launched as N processes (``WORLD_SIZE``) while accelerate sees fewer: on a machine without CUDA,
      ``torchrun`` alone makes accelerate run every process as its own 1-process job, each training alone;
    * DeepSpeed (``configs/accelerate/zero*.yaml``): accelerate steps a DeepSpeed optimizer inside every
      ``backward`` at a sync point and clips by its own config, which this trainer's micro-batch
      accumulation, loss normaliser and non-finite guard do not drive yet (found on CPU with DeepSpeed
      0.19: the optimizer stepped after each micro-batch). Use FSDP2 (``configs/accelerate/fsdp.yaml``),
      tested against the 1-process update in ``tests/trainers/test_fsdp.py``."""
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and acc.num_processes != launched:
        raise RuntimeError(
            f"launched as {launched} processes (WORLD_SIZE) but accelerate sees {acc.num_processes}: on a machine "
            "without CUDA set ACCELERATE_USE_CPU=true or use `accelerate launch --cpu`; otherwise every process "
            "would train alone on its own copy")
    if getattr(acc.state, "deepspeed_plugin", None) is not None:
        raise RuntimeError("DeepSpeed (ZeRO) is not supported by unialign's trainers yet: their micro-batch "
                           "accumulation and non-finite guard would be bypassed. Use FSDP2: accelerate launch "
                           "--config_file configs/accelerate/fsdp.yaml ...")


class StopSignals:
    """While inside: SIGTERM and SIGINT are noted (``received``: the signal's number, 0 before one) instead of
    ending the process, so the loop can finish its step and save; a second one stops at once (the previous
    handlers apply). Installed only in the main thread (elsewhere ``received`` stays 0)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, Any] = {}

    def _note(self, signum: int, frame: Any) -> None:
        if self.received:  # the second signal: stop now, as if nothing were installed
            self._restore()
            signal.raise_signal(signum)
            return
        self.received = signum
        print(f"\n{signal.Signals(signum).name} received: finishing this step, then saving a checkpoint (send it "
              "again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc: Any) -> None:
        self._restore()


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
