"""Training loops: the only place accelerate is imported. They see the Policy protocol, never a model class."""

from unialign.trainers.common import finish_run, write_json_atomic
from unialign.trainers.online import OnlineConfig, OnlineTrainer, RatioCheckError

__all__ = ["OnlineConfig", "finish_run", "OnlineTrainer", "RatioCheckError", "write_json_atomic"]
