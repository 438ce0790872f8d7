"""transformers / TRL ``TrainerCallback`` objects, run by unialign's loops at TRL's events with TRL's arguments.

A callback is any object with some of the methods ``on_train_begin``, ``on_step_end``, ``on_log``, ``on_evaluate``,
``on_save``, ``on_train_end`` (a ``transformers.TrainerCallback`` subclass, or a plain object); each is called as
transformers calls it, ``method(args, state, control, **kwargs)``: ``args`` the run's config, ``state`` a ``TrainerState`` (the fields of
transformers' a callback reads: ``global_step``, ``max_steps``, ``log_history``, ``is_world_process_zero``, ...),
``control`` a ``TrainerControl`` (transformers' flags); ``on_log`` gets ``logs=`` (the step's metrics),
``on_evaluate`` ``metrics=`` (the held-out numbers), every event ``model=``, ``optimizer=`` and ``lr_scheduler=``. A
method may return a control object (it replaces the run's) or set ``control.should_training_stop``: the loop then
stops after that step, with its final evaluation, checkpoint and ``final/`` as at ``max_steps``. The two classes are
written here, not imported, so the trainers need no modality library (transformers' are plain dataclasses too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainerState:
    """transformers' ``TrainerState`` fields a callback reads, as the loop has them."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float | None = None
    log_history: list[dict[str, Any]] = field(default_factory=list)
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True
    best_metric: float | None = None
    best_model_checkpoint: str | None = None


@dataclass
class TrainerControl:
    """transformers' ``TrainerControl`` flags; the loop reads ``should_training_stop``."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

EVENTS = ("on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")


class Callbacks:
    """The callbacks of one run and the ``TrainerState`` / ``TrainerControl`` they see."""

    def __init__(self, args: Any, callbacks: list | tuple = (), is_main: bool = True):
        self.args = args
        self.state = TrainerState(max_steps=args.max_steps, is_world_process_zero=is_main,
                                  is_local_process_zero=is_main)
        self.control = TrainerControl()
        self.items: list[Any] = []
        for cb in callbacks:
            self.add(cb)

    def add(self, callback: Any) -> None:
        """A callback object, or a class (made with no arguments, as transformers does)."""
        self.items.append(callback() if isinstance(callback, type) else callback)

    def remove(self, callback: Any) -> Any:
        """Remove (and return) a callback given as the object or its class; None when there is none."""
        for cb in self.items:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.items.remove(cb)
                return cb
        return None

    def fire(self, event: str, step: int, history: list[dict[str, Any]], **kwargs: Any) -> None:
        """Call ``event`` on every callback that has it, the state at ``step`` with ``history`` as its log."""
        if not self.items:
            return
        self.state.global_step, self.state.log_history = step, history
        for cb in self.items:
            method = getattr(cb, event, None)
            if method is None:
                continue
            out = method(self.args, self.state, self.control, **kwargs)
            if out is not None and hasattr(out, "should_training_stop"):  # a control object, ours or transformers'
                self.control = out

    @property
    def should_stop(self) -> bool:
        return bool(self.control.should_training_stop)
