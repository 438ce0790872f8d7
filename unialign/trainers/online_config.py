"""The on-policy loop's config: its own knobs (groups, generation rounds, reward errors and timeout, the rollout
correction), then every knob of the algorithm (``unialign.registry.AlgoOverrides``), over ``TrainConfig``'s."""

from __future__ import annotations

from dataclasses import dataclass

from unialign import algos
from unialign.config import arg
from unialign.errors import UserError
from unialign.registry import (
    ALGORITHMS,
    KNOBS,
    AlgoOverrides,
    AlgoSpec,
    diffusion_preset_refused,
    get_algorithm,
)
from unialign.rewards.base import DEFAULT_REWARD_TIMEOUT_S, ON_ERROR
from unialign.trainers.train_config import TrainConfig


@dataclass
class _OnlineLoopConfig(TrainConfig):
    """Knobs of the on-policy loop itself (``OnlineConfig`` adds the algorithm's, ``AlgoOverrides``)."""

    algorithm: str = arg("grpo", "algorithm preset (unialign.registry.ALGORITHMS); the fields below left unset take "
                         "its values", group="algorithm", choices=ALGORITHMS, hint=diffusion_preset_refused)
    num_generations: int = arg(8, "samples per prompt (the group size G)", group="algorithm", min=1)
    prompts_per_step: int = arg(16, "prompts per optimizer batch (all processes together)", group="algorithm", min=1)
    micro_batch_size: int = arg(32, "samples per forward/backward pass (memory only; the update is the same)",
                                group="optimisation", min=1)
    num_mini_batches: int = arg(1, "optimizer steps per batch of samples, per epoch", group="optimisation", min=1)
    max_steps: int = arg(50, "training iterations (sample, score, update) to run (>= 1)")
    max_completion_length: int | None = arg(
        None, "completion limit in tokens for the loss normaliser and DAPO's overlong buffer (scripts set it to "
        "max_new_tokens)", group="algorithm", min=1)
    max_generation_rounds: int = arg(3, "DAPO dynamic sampling: sampling rounds per step at most", group="algorithm",
                                     min=1)
    ratio_check_tol: float | None = arg(
        None, "tolerance of the first step's sampling vs training log-prob check (default 1e-3 in float32, 5e-2 "
        "in half precision)", group="algorithm", gt=0.0)
    eval_steps: int = arg(0, "run the held-out evaluator every N steps (0: before and after only)", group="logging",
                          min=0)
    reward_errors: str = arg(
        "raise", "a reward function that raises or returns non-numbers: 'raise' (stop, naming the function and the "
        "sample; progress so far is checkpointed) or 'skip' (count them in reward_errors and exclude those "
        "samples, like NaN rewards)", group="algorithm", choices=ON_ERROR)
    reward_timeout: float | None = arg(
        DEFAULT_REWARD_TIMEOUT_S, "seconds one reward function may take on one batch: a call still running then is "
        "stopped and named (reward, limit, step); --reward_errors raise stops the run (steps so far checkpointed), "
        "skip scores that batch as reward errors. 0 or none: no limit (10 minutes is also torch's NCCL timeout, after "
        "which a multi-GPU run would fail anyway)", group="algorithm", min=0.0)
    async_rollouts: bool = arg(
        False, "sample the next batches in a background thread, on a copy of the weights lagging the trained ones by "
        "max_staleness optimizer steps, while the trainer updates (TRL's AsyncGRPOTrainer; docs/scaling.md); stale "
        "batches are corrected by --rollout_correction. Off: sample, then update", group="algorithm")
    max_staleness: int = arg(
        1, "async rollouts: how many optimizer steps the sampling weights lag (TRL's name); 0 runs the synchronous "
        "schedule through the same thread", group="algorithm", min=0)
    # rollout engine vs trainer (vLLM, --rollout_dtype, async rollouts): applies when log-probs of another sampler exist
    rollout_correction: str = arg(
        "truncate", "importance-sampling correction when sampling ran on another engine than the trained model, or on "
        "older weights (async rollouts), its log-probs recorded: truncate (TIS: min(ratio, cap)), mask (MIS: 0 above cap) or off; the mismatch "
        "metrics are logged either way", group="algorithm", choices=("truncate", "mask", "off"))
    rollout_correction_level: str = arg(
        "token", "rollout correction ratio per token, or per sequence (product of its token ratios)",
        group="algorithm", choices=algos.ROLLOUT_CORRECTION_LEVELS)
    rollout_correction_cap: float = arg(2.0, "rollout correction: ratios above this are truncated / masked",
                                        group="algorithm", gt=0.0)


@dataclass
class OnlineConfig(AlgoOverrides, _OnlineLoopConfig):
    """Knobs of the on-policy loop, then the algorithm's (``unialign.registry.AlgoOverrides``, one per
    ``AlgoSpec`` knob): left at None, a knob takes the preset's (``algorithm``) value."""

    ALGORITHM_KNOBS = KNOBS  # the fields that follow ``algorithm`` (unialign.config.parse_config)

    def algo_spec(self) -> AlgoSpec:
        """The preset ``self.algorithm`` with every knob this config sets (non-None) applied."""
        return get_algorithm(self.algorithm, **{n: getattr(self, n) for n in KNOBS})

    def check(self) -> None:
        """The checks of fields together (``unialign.config.validate`` runs them after every field passed its own
        rules): the algorithm with its overrides, a group of >= 2 samples for an estimator with group baselines
        (as its registry entry says), then ``TrainConfig``'s."""
        try:
            spec = self.algo_spec()
        except (ValueError, TypeError) as err:
            raise UserError(f"--algorithm: {err}") from None
        if self.num_generations < 2 and algos.get_estimator(spec.advantage).uses_groups:
            raise UserError(f"--num_generations: must be >= 2 for {spec.name} (group baselines), got "
                            f"{self.num_generations}")
        if self.async_rollouts and spec.dynamic_sampling:
            raise UserError(f"--async_rollouts: {spec.name}'s dynamic sampling samples again within a step, from the "
                            "current weights; turn one of them off (--dynamic_sampling false)")
        super().check()
