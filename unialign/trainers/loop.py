"""The skeleton both loops share: set-up, accelerate preparation, the step loop, logging, held-out
evaluation bookkeeping, checkpoint and resume. ``OnlineTrainer`` (sample, score, update) and
``PreferenceTrainer`` (pairs) subclass it and write only what differs:

    train_step()          one iteration; returns its stats (the loop adds step, step_seconds, lr, counters)
    evaluate()            held-out numbers, recorded through ``_record_eval`` (with the evaluator's sample table,
                          if it keeps one: ``<output_dir>/completions.jsonl`` and a tracker table)
    save_curves()         the run's PNG curves (main process)
    _extra_state() / _load_extra_state(state)   what a checkpoint holds beyond the shared fields
    _progress(stats)      the progress bar's postfix
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, broadcast, set_seed
from tqdm.auto import tqdm

from unialign.config import validate
from unialign.files import append_text, write_text, writing
from unialign.trainers import rundir
from unialign.trainers.callbacks import Callbacks
from unialign.trainers.checkpoint import (
    STATE_TENSORS_FILE,
    agreed,
    generator_states,
    preserved_random_state,
    read_random_states,
    save_checkpoint,
    set_generator_states,
    set_source_state_tensors,
    source_state_tensors,
)
from unialign.trainers.launch import StopSignals, check_launch, watch_launcher
from unialign.trainers.outputs import (
    announce_defaults,
    json_line,
    json_safe,
    log_images,
    log_table,
    read_jsonl,
)
from unialign.trainers.resume import load_checkpoint, plan_resume, resume_settings
from unialign.trainers.schedule import make_optimizer

# below this many parameters a CPU run sets one torch thread when num_threads is unset: small kernels gain nothing
# from threads and lose much when the cores are shared (the shipped 0.5 M-parameter model, 6 GRPO steps through the
# Python API: 9-10 s either way on a quiet 2-core machine; 6.1 s on 1 thread vs 8.1 s on 2 beside a test run; 8.6 s
# vs 51 s reported on a busier shared machine)
SMALL_MODEL_PARAMS = 20_000_000
COMPLETIONS_FILE = "completions.jsonl"  # the held-out sample table of every evaluation, one JSON object per row
COMPLETIONS_TAG = "eval/completions"  # its tracker name (TensorBoard: a text summary holding a markdown table)


def autocast_context(mixed_precision: str, acc: Accelerator):
    """``--mixed_precision``'s autocast: bf16 -> ``torch.autocast`` in bfloat16 on the accelerator's device (weights
    stay in their dtype; no loss scaling needed); fp16 -> accelerate's (its GradScaler, a GPU); no -> nothing."""
    if mixed_precision == "bf16":
        return torch.autocast(acc.device.type, dtype=torch.bfloat16)
    return acc.autocast()  # fp16 when the accelerator was made with it, else a no-op


class TrainerLoop:
    progress_desc = "train"

    # ------------------------------------------------------------------ set-up
    def _open(self, config: Any, rows: list[dict[str, Any]], settings: dict[str, Any],
              accelerator: Accelerator | None) -> None:
        """Check the config, plan a resume (refused here, before any weights move: ``settings`` are the knobs a
        resume must not change silently), take the output directory for this run (``rundir.claim``: a lock, and
        the run id its checkpoints carry; a resume continues its checkpoint's run) and make the accelerator, whose
        tracker logs go to ``<output_dir>/logs/<run_id>``."""
        validate(config)  # the checks the scripts run at parse time, for configs built in Python
        self.cfg = config
        self.resume_settings = resume_settings(config, rows, **settings)
        self._resume = plan_resume(config, self.resume_settings)
        resumed_id = self._resume.state.get("run_id") if self._resume is not None else None
        self.run = rundir.claim(config.output_dir, self._resume is not None, config.overwrite_output_dir, resumed_id)
        self.config_changes: list[dict] = []
        out = Path(config.output_dir)
        self.acc = accelerator or Accelerator(
            log_with=None if config.report_to == "none" else config.report_to,
            # fp16 through accelerate (its loss scaling); bf16 is torch's autocast (``autocast``), which needs
            # none and leaves accelerate's process-wide state alone (a second run in one process may differ)
            mixed_precision="fp16" if getattr(config, "mixed_precision", "no") == "fp16" else "no",
            project_config=ProjectConfiguration(project_dir=str(out),
                                                logging_dir=str(out / "logs" / (self.run.run_id or "run"))))
        check_launch(self.acc)
        watch_launcher()  # under `accelerate launch`: the launcher exiting is a stop request, not an orphaned run
        self.run_id = agreed(self.acc, self.run.run_id)  # every process names temporary folders alike
        announce_defaults(self.acc, config)  # a model's own defaults, and where the defaults differ from TRL's
        self.callbacks = Callbacks(config, is_main=self.acc.is_main_process)  # TrainerCallbacks (add_callback)
        # completions.jsonl: a resume keeps the rows of the steps its checkpoint covers (see _write_samples)
        self._samples_resume_step = self._resume.state["step"] if self._resume is not None else None
        self._samples_started = False
        self._sample_steps: set[int] = set()  # the steps completions.jsonl holds rows of

    def _prepare(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> torch.nn.Module:
        """Seed, threads, optimizer and schedule, ``accelerate.prepare``; returns the prepared model."""
        cfg = self.cfg
        set_seed(cfg.seed)
        threads = cfg.num_threads
        if threads is None:  # unset: one thread for a small model on CPU, where torch's several are slower
            size = sum(p.numel() for p in model.parameters())
            if self.acc.device.type == "cpu" and size < SMALL_MODEL_PARAMS:
                threads = 1
                self.acc.print(f"num_threads=1: a {size / 1e6:.1f} M-parameter model on CPU runs fastest on one "
                               f"thread (--num_threads 0: torch's choice)")
        if threads and threads > 0:  # <= 0: leave torch's choice
            torch.set_num_threads(threads)
        self.optimizer, self.scheduler = make_optimizer(params, cfg)
        model, self.optimizer, self.scheduler = self.acc.prepare(model, self.optimizer, self.scheduler)
        self._callback_model = model  # what a TrainerCallback's ``model=`` is
        self.step, self.cursor, self.history = 0, 0, []
        self._last_eval: tuple[int, dict[str, float]] | None = None
        self._trackers = "new"  # new -> open -> closed
        return model

    # ------------------------------------------------------------------ logging
    def _tracker_writes(self):
        """Around a call that writes tracker logs: a full disk there is ``DiskFullError`` naming the log folder
        (TensorBoard's writer raises its thread's error at the next call; its event files tolerate a cut last
        record)."""
        return writing(None, f"the tracker logs in {Path(self.cfg.output_dir) / 'logs'}")

    def _start_trackers(self) -> None:
        if self._trackers == "new":
            with self._tracker_writes():
                self.acc.init_trackers("unialign", config={k: v for k, v in asdict(self.cfg).items() if v is not None})
            self._trackers = "open"

    def _log(self, metrics: dict[str, Any], images: dict[str, Any] | None = None,
             samples: list[dict[str, Any]] | None = None) -> None:
        with self._tracker_writes():
            self.acc.log(metrics, step=self.step)
            log_images(self.acc, images or {}, self.step)
            log_table(self.acc, COMPLETIONS_TAG, samples or [], self.step)

    def _end_trackers(self) -> None:
        with self._tracker_writes():
            self.acc.end_training()
        self._trackers = "closed"

    def _record_eval(self, metrics: dict[str, float], images: dict[str, Any] | None = None,
                     samples: list[dict[str, Any]] | None = None) -> None:
        """Held-out numbers (already ``eval/``-prefixed) into this step's history entry (a new one before the
        first step) and, while the trackers are open, to them; images to the trackers. ``samples`` (rows of
        prompt, completion and one score per scorer, e.g. ``GreedyHeldOut.samples``) go to
        ``completions.jsonl`` (``_write_samples``) and, as a table, to the trackers (``log_table``); they never
        enter the history, the checkpoints or summary.json, whose values stay numbers."""
        self._last_eval = (self.step, metrics)
        if self.history and self.history[-1].get("step") == self.step:
            self.history[-1].update(metrics)
        else:
            self.history.append({"step": self.step, **metrics})
        self._write_samples(samples or [])
        self._start_trackers()
        if self._trackers == "open":
            self._log(metrics, images, samples)

    def _write_samples(self, samples: list[dict[str, Any]]) -> None:
        """Add this step's ``samples`` to ``<output_dir>/completions.jsonl`` (main process only), one JSON object
        per row: ``{"step", "prompt", "completion", <scorer>: <score or null>, ...}`` (strict JSON, NaN as null).
        The first write of a process starts the file afresh (replaced atomically); a resumed run starts it from
        the old file's rows of the steps its checkpoint covers (up to the checkpoint's step). Rows of a step the
        file already holds (a resumed run evaluates its checkpoint's step again) replace that step's rows, so no
        step is doubled; other writes append whole lines (a failed append leaves the file as it was; a line cut
        short by a crash is skipped when a resume reads the file)."""
        if not samples or not self.acc.is_main_process:
            return
        path = Path(self.cfg.output_dir) / COMPLETIONS_FILE
        what = f"the sample table {path}"
        rows = [{"step": self.step, **json_safe(s)} for s in samples]
        if self._samples_started and self.step not in self._sample_steps:
            append_text(path, "".join(json_line(r) for r in rows), what)
            self._sample_steps.add(self.step)
            return
        if self._samples_started:
            kept = read_jsonl(path)
        else:
            upto = self._samples_resume_step
            kept = [] if upto is None else [r for r in read_jsonl(path) if r["step"] <= upto]
        kept = [r for r in kept if r["step"] != self.step] + rows
        write_text(path, "".join(json_line(r) for r in sorted(kept, key=lambda r: r["step"])), what)
        self._sample_steps = {r["step"] for r in kept}
        self._samples_started = True

    def _cached_eval(self) -> dict[str, float] | None:
        """This step's held-out numbers when they were computed already (asking twice computes once)."""
        return self._last_eval[1] if self._last_eval is not None and self._last_eval[0] == self.step else None

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        state = {"step": self.step, "cursor": self.cursor, "history": self.history, "counters": self.counters,
                 "settings": self.resume_settings, "config_changes": self.config_changes,
                 "config": asdict(self.cfg), **self._extra_state()}
        path = save_checkpoint(self.acc, self.cfg.output_dir, self.step, state, self.cfg.save_total_limit,
                               self.run_id, random_states=generator_states(self._random_sources()),
                               legacy=self.run.legacy, state_tensors=source_state_tensors(self._random_sources()))
        self._last_save = time.monotonic()
        self._fire("on_save")
        return path

    def load_checkpoint(self, resume: Any) -> None:
        """Restore weights, optimizer, every random state and the loop's state from a checkpoint ``plan_resume``
        accepted."""
        state = load_checkpoint(self.acc, resume, self.optimizer, self.scheduler, self.cfg)
        set_generator_states(self._random_sources(), read_random_states(resume.path), resume.path)
        set_source_state_tensors(self._random_sources(), read_random_states(resume.path, STATE_TENSORS_FILE))
        self.config_changes = state.get("config_changes") or []
        self.step, self.cursor, self.history = state["step"], state["cursor"], state["history"]
        self.counters = state["counters"]
        self._load_extra_state(state)

    def _random_sources(self) -> dict[str, Any]:
        """The objects whose own ``torch.Generator``s a checkpoint must carry, by name (their ``generators()``;
        the global torch / numpy / Python RNGs are accelerate's). The policy's, by default."""
        return {"policy": getattr(self, "policy", None)}

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------ the loop
    def train(self) -> list[dict]:
        """The step loop. A checkpoint is written every ``save_steps`` steps, when ``save_minutes`` of wall-clock
        passed since the last one, and at the end; SIGTERM or SIGINT (Ctrl-C) let the current step finish, write a
        checkpoint and exit with status 128 + the signal's number, naming the checkpoint (a second signal stops at
        once)."""
        cfg, acc = self.cfg, self.acc
        if self._resume is not None:
            self.load_checkpoint(self._resume)
            acc.print(f"resumed from {self._resume.path} at step {self.step}")
            for c in self._resume.changes:
                acc.print(f"  setting changed on resume: {c['field']}: {c['old']!r} -> {c['new']!r}")
            self._resume = None
        if acc.is_main_process:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        self._start_trackers()
        self._last_save = time.monotonic()
        self._fire("on_train_begin")
        bar = tqdm(total=cfg.max_steps, initial=self.step, disable=not acc.is_local_main_process, desc=self.progress_desc)
        last = "the last checkpoint is whole" if cfg.save_steps or cfg.save_minutes else "no checkpoint is saved"
        with StopSignals(second=f"no checkpoint of this step ({last}; --resume_from_checkpoint latest)",
                         log_dir=cfg.output_dir) as stop:
            while self.step < cfg.max_steps:
                t0 = time.perf_counter()
                lr = self.scheduler.get_last_lr()[0]  # the learning rate this step trains with, as TRL logs it
                stats = self.train_step()
                self.step += 1
                stats.update({"step": self.step, "step_seconds": time.perf_counter() - t0, "lr": lr,
                              "learning_rate": lr, **self.counters})  # TRL's name beside unialign's
                self.history.append(stats)
                self._fire("on_step_end")
                if self.step % cfg.logging_steps == 0:
                    with self._tracker_writes():
                        acc.log({k: v for k, v in stats.items() if k != "step"}, step=self.step)
                    self._fire("on_log", logs=dict(stats))
                if cfg.eval_steps and self.step % cfg.eval_steps == 0:
                    self._scheduled_eval()
                bar.update(1)
                bar.set_postfix(**self._progress(stats))
                signum = self._agree(stop.received)
                if signum:
                    self._stop_for_signal(signum, bar)
                due = cfg.save_minutes and time.monotonic() - self._last_save >= 60 * cfg.save_minutes
                if self.step < cfg.max_steps and ((cfg.save_steps and self.step % cfg.save_steps == 0)
                                                  or self._agree(int(bool(due)))):
                    self.save_checkpoint()
                if self.callbacks.items and self._agree(int(self.callbacks.should_stop)):  # a callback asked: end here
                    acc.print(f"stopped by a callback (control.should_training_stop) after step {self.step}")
                    break
            bar.close()
            self._scheduled_eval()  # the final held-out numbers, while the trackers are open (cached if just run)
            path = self.save_checkpoint()
            signum = self._agree(stop.received)
            if signum:  # a signal during the final evaluation or save: that checkpoint is whole, final/ is not written
                self._stop_for_signal(signum, bar, path)
        if acc.is_main_process:
            self.save_curves()
        self._end_trackers()
        self._fire("on_train_end")
        return self.history

    def autocast(self):
        """The forward passes' autocast for ``cfg.mixed_precision`` (``autocast_context``)."""
        return autocast_context(getattr(self.cfg, "mixed_precision", "no"), self.acc)

    def _fire(self, event: str, **kwargs: Any) -> None:
        """A ``TrainerCallback`` event (``unialign.trainers.callbacks``), with the model and optimizer as
        transformers passes them."""
        self.callbacks.fire(event, self.step, self.history, model=getattr(self, "_callback_model", None),
                            optimizer=getattr(self, "optimizer", None), lr_scheduler=getattr(self, "scheduler", None),
                            **kwargs)

    def _agree(self, value: int) -> int:
        """``value`` as the main process has it, on every process (a signal or a clock decides a save only where
        all processes take it at the same step)."""
        if self.acc.num_processes == 1:
            return value
        return int(broadcast(torch.tensor([value], device=self.acc.device), from_process=0).item())

    def _stop_for_signal(self, signum: int, bar, path: Path | None = None) -> None:
        bar.close()
        path = path or self.save_checkpoint()
        self._end_trackers()
        name = signal.Signals(signum).name
        self.acc.print(f"stopped by {name} after step {self.step} of {self.cfg.max_steps}: saved {path}; continue with "
                       "--resume_from_checkpoint latest", file=sys.stderr)
        raise SystemExit(128 + signum)

    def _scheduled_eval(self) -> None:
        with preserved_random_state(self._random_sources()):
            metrics = self.evaluate()
        self._fire("on_evaluate", metrics=dict(metrics or {}))

    # ------------------------------------------------------------------ what a loop writes
    def train_step(self) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def save_curves(self) -> None:
        raise NotImplementedError

    def _progress(self, stats: dict[str, Any]) -> dict[str, str]:
        return {}
