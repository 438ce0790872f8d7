"""The fields every trainer loop shares: optimisation, schedule, seeding, logging and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from unialign.config import OPTIMIZERS, REPORT_TO, SCHEDULERS, arg, check_output_dir, check_tracker
from unialign.errors import UserError
from unialign.trainers import rundir
from unialign.trainers.checkpoint import find_checkpoint


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
    mixed_precision: str = arg("no", "autocast the forward passes (TRL's --bf16 / --fp16): the weights stay in "
                               "their dtype, matmuls run in bf16 / fp16 (fp16: GPU only)", group="optimisation",
                               choices=("no", "bf16", "fp16"))
    seed: int = arg(0, "seed of sampling, data order and initialisation", group="optimisation")
    num_threads: int | None = arg(
        None, "torch intra-op CPU threads (<= 0: torch's choice; unset: 1 for a model under 20 M parameters on CPU, "
              "which runs fastest on one, else torch's choice)", group="model")
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
        check_tracker(self.report_to)
        if self.mixed_precision == "fp16" and not torch.cuda.is_available():
            raise UserError("--mixed_precision fp16: fp16 autocast needs a GPU (torch's CPU autocast is bf16: "
                            "--mixed_precision bf16)")
        if not str(self.output_dir).strip():
            rundir.check(self.output_dir, False, False)  # the one line for an empty name
        rundir.check_links(Path(self.output_dir))  # a broken link is named as one, not as "not writable"
        check_output_dir(self.output_dir)
        rundir.check(self.output_dir, bool(self.resume_from_checkpoint), bool(self.overwrite_output_dir))
        if self.resume_from_checkpoint:  # "latest" with nothing to resume, or a damaged checkpoint: say so now
            try:
                find_checkpoint(self.output_dir, self.resume_from_checkpoint, max_steps=self.max_steps)
            except ValueError as err:
                raise UserError(str(err)) from None
