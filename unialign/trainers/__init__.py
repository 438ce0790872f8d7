"""Training loops: the only place accelerate is imported. They see the Policy protocol, never a model class.

    loop.py          the step loop both trainers share (set-up, logging, evaluation bookkeeping, checkpoints)
    online.py        OnlineTrainer: sample, score, update (the GRPO family, PPO)
    online_config.py OnlineConfig: its knobs, then every knob of the algorithm
    preference.py    PreferenceTrainer: pairs (DPO and relatives, Bradley-Terry reward models)
    train_config.py  TrainConfig: the fields every loop shares
    schedule.py      the optimizer, the learning-rate schedules, the data order
    checkpoint.py    checkpoints: written whole, checksummed, verified before use, rotated; random states
    resume.py        what a resume must not change silently, and loading a checkpoint
    outputs.py       final/ and summary.json (finish_run), curves, tracker images and tables
    launch.py        the launcher and signals: refused launches, SIGTERM / SIGINT, a launcher that exits
    rundir.py        a run owns its output directory: the lock, run.json, refusals
"""

from unialign.files import write_json as write_json_atomic
from unialign.trainers.online import OnlineConfig, OnlineTrainer, RatioCheckError
from unialign.trainers.outputs import finish_run

__all__ = ["OnlineConfig", "finish_run", "OnlineTrainer", "RatioCheckError", "write_json_atomic"]
