"""What a resume must not change silently, and the plan of a resume: the checkpoint found and verified, its settings
compared with the run's (a difference refused, or recorded with ``--allow_config_change``), and the optimizer made
to follow the new settings when they were allowed to change."""

from __future__ import annotations

import hashlib
import json
import numbers
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unialign.files import json_safe
from unialign.trainers.checkpoint import find_checkpoint, verify_checkpoint
from unialign.trainers.train_config import TrainConfig


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


MODEL_SETTINGS = ("model_name_or_path", "vae_name_or_path")


def same_place(name: Any) -> Any:
    """A model named by a local path as the absolute path it resolves to (``my_model``, ``./my_model`` and
    ``/abs/my_model`` are one model to a resume); a Hub id, or a path that does not exist here, as given."""
    if not isinstance(name, str):
        return name
    path = Path(name).expanduser()
    try:
        return str(path.resolve()) if path.exists() else name
    except (OSError, RuntimeError):
        return name


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
    for name in MODEL_SETTINGS:
        if hasattr(cfg, name):
            settings[name] = same_place(getattr(cfg, name))
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
    old = {k: same_place(v) if k in MODEL_SETTINGS else v for k, v in old.items()}  # older checkpoints: as given
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
def load_checkpoint(acc, resume: ResumePoint, optimizer=None, scheduler=None, cfg: TrainConfig | None = None) -> dict:
    """Restore accelerate state (weights, optimizer, scheduler, RNGs; accelerate reads them with
    ``weights_only=True``) from ``resume.path`` and return the loop's own state. When settings changed
    (allowed), ``apply_optimizer_settings`` makes the optimizer follow ``cfg``. A file that needs
    unpickling is refused with a ValueError naming the checkpoint, and so is an RNG file accelerate could not read
    (it would go on without it, and the resume would not continue bit-identically)."""
    check_random_states(resume.path, acc.process_index)
    try:
        acc.load_state(str(resume.path))
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{resume.path}: refusing to load a checkpoint file that holds more than plain data "
                         f"(unpickling it could run code): {first}") from None
    if resume.changes and optimizer is not None and cfg is not None:
        apply_optimizer_settings(optimizer, scheduler, cfg)
    return resume.state




def check_random_states(ckpt: Path, process_index: int) -> None:
    """accelerate's RNG file of this process, read as accelerate reads it (plain data only): a ValueError naming
    it when that fails or it lacks a generator's state, where accelerate itself would log and go on."""
    from accelerate.utils import load

    path = Path(ckpt) / f"random_states_{process_index}.pkl"
    if not path.is_file():
        raise ValueError(f"{path}: missing; a resume without this process's random states would not continue "
                         "bit-identically")
    try:
        states = load(path)
        missing = [k for k in ("random_state", "numpy_random_seed", "torch_manual_seed") if k not in states]
    except Exception as err:  # noqa: BLE001 - whatever accelerate's reader raises, it would have skipped the file
        first = str(err).strip().splitlines()[0].split(". ")[0][:120] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: refusing to load it: not plain random-state data ({first}); unpickling it could "
                         "run code, and without it the resume would not continue bit-identically") from None
    if missing:
        raise ValueError(f"{path}: holds no {', '.join(missing)}; the checkpoint is damaged")
