"""The one on-policy loop: GRPO, DAPO, Dr.GRPO, GSPO, REINFORCE/RLOO, PPO and DDPO, on text or images.

Every iteration runs five phases, top to bottom:

    1. sample     G samples for each of P prompts (``policy.sample``); DAPO's dynamic sampling
                  drops zero-variance groups and samples again, up to ``max_generation_rounds``
    2. score      rewards (any TRL-style reward function); non-finite rewards are counted and
                  excluded from baselines (they get advantage 0)
    3. advantages the preset's estimator (``unialign.registry``); reference log-probs when the
                  KL coefficient is non-zero and the KL is a sample estimate (k1/k2/k3); values and
                  KL-shaped per-step rewards for PPO. The closed-form ``gaussian`` KL of a diffusion
                  step needs no pass here: the policy computes it beside the log-probs in phase 4
    4. update     ``num_iterations`` epochs x ``num_mini_batches`` optimizer steps, each
                  accumulated over micro-batches with ONE loss normaliser per optimizer step
    5. log / save metrics to accelerate's trackers, atomic checkpoints, reward curve; every
                  ``eval_steps`` the optional ``evaluator`` (held-out numbers and images, e.g. prompt
                  fidelity of an image policy) runs, and once more at the end

The loop sees only the ``Policy`` protocol and the registry; it never asks which modality it runs.
Departures from the papers, on purpose:
  * dynamic sampling discards surplus groups once a batch is full (verl's DAPO recipe) rather
    than carrying them over, so every update stays on-policy;
  * PPO whitens advantages per process (no cross-process whitening);
  * the first on-policy log-prob recomputation is checked against the sampling-time value and
    the run fails loudly if they differ beyond the dtype's tolerance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather, gather_object

from unialign import algos
from unialign.config import validate
from unialign.policy import (
    ClosedFormKL,
    Critic,
    KLWeights,
    LossRequest,
    LossTerms,
    OptimizerStepHook,
    Policy,
    StepChunks,
    StepStatistics,
)
from unialign.registry import (
    KNOBS,
    AlgoSpec,
)
from unialign.rewards.base import CombinedReward, RewardError
from unialign.trainers.async_rollouts import AsyncRollouts, RolloutJob
from unialign.trainers.loop import TrainerLoop
from unialign.trainers.online_config import OnlineConfig
from unialign.trainers.outputs import save_curves, save_step_ratios
from unialign.trainers.schedule import epoch_order
from unialign.types import Trajectory


def overlong_cache_tokens(cache_len: float, max_completion_length: int | None) -> int:
    """DAPO's buffer L_cache in tokens: ``cache_len`` itself when >= 1, else that fraction of the limit
    (rounded, at least 1); 0 (off) without a limit or with ``cache_len`` 0."""
    if cache_len < 0:
        raise ValueError(f"overlong_cache_len must be >= 0, got {cache_len}")
    if not cache_len or not max_completion_length:
        return 0
    tokens = int(cache_len) if cache_len >= 1 else max(1, round(cache_len * max_completion_length))
    return min(tokens, max_completion_length)


def explained_variance(values_B_T: torch.Tensor, returns_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the unmasked steps: how much of the returns' spread the value head
    predicts (1 perfect, 0 no better than a constant, negative worse). All [B, T]; NaN when Var(R) is 0."""
    n = mask_B_T.sum()
    if n < 2:
        return math.nan

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * mask_B_T).sum() / n
        return (((x - mean) * mask_B_T) ** 2).sum() / (n - 1)

    var_r = var(returns_B_T)
    return float(1 - var(returns_B_T - values_B_T) / var_r) if var_r > 0 else math.nan


def curve_keys(spec: AlgoSpec, history: list[dict]) -> list[str]:
    """The panels of ``reward_curve.png`` for ``spec``: the training reward (smoothed), the evaluator's
    held-out numbers (``eval/*`` except spreads and per-part breakdowns, a reward's strict verdict kept), the
    loss; then, where they vary: the KL (in the loss, or the per-sequence KL in PPO's reward), the learning rate, the clip
    fraction, the share of zero-spread groups (group baselines only: GRPO family, RLOO), PPO's value loss
    and explained variance, and the entropy (logged only where it depends on the weights)."""
    evals = sorted({k for h in history for k in h if k.startswith("eval/") and not k.endswith("_std")
                    and (not k.startswith(("eval/fidelity/", "eval/rewards/")) or k.endswith("/strict"))})
    always = ["reward/mean", *evals, "loss"]
    varying = []
    if spec.beta > 0:
        varying.append("kl_seq" if spec.kl_in_reward else "kl")
    varying += ["lr", "clip_frac"]
    if algos.get_estimator(spec.advantage).uses_groups:
        varying.append("frac_reward_zero_std")
    if spec.value_coef > 0:
        varying += ["value_loss", "explained_variance"]
    varying.append("entropy")

    def values(key: str) -> list[float]:
        return [h[key] for h in history if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]

    present = [k for k in always if values(k)]
    return present + [k for k in varying if len(set(values(k))) > 1]


class RatioCheckError(RuntimeError):
    pass


# TRL's GRPOTrainer names of the step metrics, logged beside unialign's (each reward function's mean is also
# TRL's rewards/<name>/mean)
TRL_ONLINE_NAMES = {"reward/mean": "reward", "reward/std": "reward_std", "completion_length": "completions/mean_length",
                    "truncated_frac": "completions/clipped_ratio", "clip_frac": "clip_ratio/region_mean",
                    "clip_frac_low": "clip_ratio/low_mean", "clip_frac_high": "clip_ratio/high_mean"}


class OnlineTrainer(TrainerLoop):
    """Trains ``policy`` on prompts rows (dicts with a ``prompt`` key; other keys are passed to the
    reward as dataset columns) to maximise ``reward_fn`` under the preset of ``config.algorithm``."""

    def __init__(self, policy: Policy, reward_fn: Callable | list[Callable] | CombinedReward, prompts: list[dict[str, Any]], config: OnlineConfig,
                 accelerator: Accelerator | None = None, evaluator: Callable[[], dict[str, float]] | None = None):
        if isinstance(policy, (str, os.PathLike)):
            raise TypeError(f"OnlineTrainer takes a policy object (e.g. CausalLMPolicy.from_pretrained({str(policy)!r}))"
                            ", not a model name; TRL's signature is unialign.GRPOTrainer(model, reward_funcs, "
                            "args=GRPOConfig(...), train_dataset=...)")
        if not prompts:
            raise ValueError("prompts: the training set is empty")
        validate(config)  # before anything reads the config (algo_spec)
        for i, row in enumerate(prompts):
            if "prompt" not in row:
                raise ValueError(f"prompts[{i}]: missing the 'prompt' field (keys: {sorted(row)})")
        if not isinstance(reward_fn, CombinedReward):
            reward_fn = CombinedReward(list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn])
        self.policy, self.reward_fn, self.rows = policy, reward_fn, prompts
        self.spec = config.algo_spec()
        self.progress_desc = self.spec.name
        overlong_cache_tokens(self.spec.overlong_cache_len, config.max_completion_length)  # validates, before training
        self._open(config, prompts, dict(
            algorithm=self.spec.name, **{k: getattr(self.spec, k) for k in KNOBS},
            num_generations=config.num_generations, prompts_per_step=config.prompts_per_step,
            num_mini_batches=config.num_mini_batches, max_completion_length=config.max_completion_length,
            max_generation_rounds=config.max_generation_rounds,
            reward_funcs=[f.name for f in reward_fn.functions], reward_weights=reward_fn.weights), accelerator)
        world = self.acc.num_processes
        if config.prompts_per_step % world:
            raise ValueError(f"prompts_per_step={config.prompts_per_step} must be divisible by the {world} processes")
        self.estimator = algos.get_estimator(self.spec.advantage)
        self.policy_loss = algos.get_policy_loss(self.spec.policy_loss)
        if config.num_generations < 2 and self.estimator.uses_groups:
            raise ValueError(f"num_generations must be >= 2 for {self.spec.name} (group baselines)")
        if self.estimator.needs_critic and not (isinstance(policy, Critic) and policy.has_critic):
            raise ValueError(f"{self.spec.name}'s advantage estimator {self.spec.advantage!r} needs a critic, and "
                             f"this {type(policy).__name__} has none (text: build it with value_head=True / "
                             "--value_head; or choose a critic-free algorithm: grpo, rloo, reinforce_pp, ...)")
        if self.spec.value_coef > 0 and not self.estimator.needs_critic:
            raise ValueError(f"value_coef={self.spec.value_coef} trains a critic, but the advantage estimator "
                             f"{self.spec.advantage!r} uses none: set value_coef 0")
        if self.spec.kl_in_reward and self.spec.beta > 0 and not self.estimator.needs_step_rewards:
            raise ValueError(f"kl_in_reward puts the KL into per-step rewards, which the advantage estimator "
                             f"{self.spec.advantage!r} does not read: use a loss KL (kl_in_reward false)")
        algos.check_kl_estimator(self.spec.kl_estimator)
        estimator = policy.log_prob_estimator
        if estimator != self.spec.log_prob_estimator:
            raise ValueError(f"{self.spec.name} trains on the {self.spec.log_prob_estimator!r} log-prob estimator, "
                             f"but this {type(policy).__name__} provides {estimator!r} (a denoiser: "
                             "policy.use_forward_process() for 'forward'; the image scripts choose it from the algorithm; "
                             "a masked-diffusion LM: its estimator, MaskedDiffusionLMPolicy(estimator=...); a causal LM "
                             "computes exact token log-probs, 'sampler', and takes no masked-diffusion preset)")
        loss_inputs = tuple(getattr(self.policy_loss, "inputs", ()))  # registered losses carry fn.inputs
        if loss_inputs and not isinstance(policy, LossTerms):
            raise ValueError(f"policy_loss={self.spec.policy_loss!r} reads {list(loss_inputs)} from the policy "
                             f"(log_prob_terms), which {type(policy).__name__} does not provide")
        if self.spec.ema_beta > 0:  # the trust term to the policy's old weights (AWM's), a term of the same forward
            if not isinstance(policy, LossTerms):
                raise ValueError(f"ema_beta={self.spec.ema_beta} reads mean (pred - pred_old)^2 from the policy "
                                 f"(log_prob_terms), which {type(policy).__name__} does not provide: set ema_beta 0")
            loss_inputs += ("old_mse",)
        if loss_inputs:
            try:  # what the terms need is recorded at sampling (a flow policy's step means)
                policy.prepare_terms(loss_inputs)
            except ValueError as err:
                raise ValueError(f"{self.spec.name} (policy_loss={self.spec.policy_loss!r}, ema_beta="
                                 f"{self.spec.ema_beta}): {err}") from None
        # a loss that couples a group's samples (DGPO) gets micro-batches of whole groups
        self.whole_groups = bool(getattr(self.policy_loss, "whole_groups", False))
        if self.whole_groups:
            G, per_mini = config.num_generations, config.prompts_per_step // max(1, config.num_mini_batches)
            if config.micro_batch_size % G or config.prompts_per_step % max(1, config.num_mini_batches):
                raise ValueError(f"micro_batch_size={config.micro_batch_size} / num_mini_batches="
                                 f"{config.num_mini_batches}: {self.spec.name}'s loss couples each group's samples, "
                                 f"so micro-batches hold whole groups of num_generations={G} (a multiple of it) and "
                                 f"every mini-batch whole prompts ({per_mini} of {config.prompts_per_step})")
        # per-step statistics of the importance ratio where steps are the same for every sample (denoising steps)
        self.step_diagnostics = isinstance(policy, StepStatistics) and policy.per_step_diagnostics
        # a closed-form KL comes from the policy's own forward (it needs both step means)
        kl_from_policy = self.spec.beta > 0 and self.spec.kl_estimator in algos.CLOSED_FORM_ESTIMATORS
        if kl_from_policy:
            if not isinstance(policy, ClosedFormKL):
                raise ValueError(f"kl_estimator={self.spec.kl_estimator!r} needs a policy with Gaussian steps and "
                                 f"log_prob_and_kl() (DiffusionPolicy); {type(policy).__name__} has none: use k1, k2 or k3")
            offered = policy.closed_form_kls
            if self.spec.kl_estimator not in offered:
                raise ValueError(f"kl_estimator={self.spec.kl_estimator!r}: this {type(policy).__name__}'s log-prob "
                                 f"offers the closed forms {list(offered)} (or k1, k2, k3)")
            if self.spec.kl_estimator in algos.NEEDS_KL_WEIGHTS and not isinstance(policy, KLWeights):
                raise ValueError(f"kl_estimator={self.spec.kl_estimator!r} (Flow-GRPO's KL) needs a flow-matching "
                                 f"policy's kl_weights(); {type(policy).__name__} has none: use 'gaussian'")
            if self.spec.kl_in_reward or self.spec.value_coef > 0:
                raise ValueError(f"kl_estimator={self.spec.kl_estimator!r} is a KL term in the loss; it cannot be "
                                 f"combined with {self.spec.name}'s KL-in-reward or critic: use k1, k2 or k3")
        # what every loss asks of the policy's forward (the capabilities it needs were checked above)
        self._request = LossRequest(values=self.spec.value_coef > 0,
                                    kl=self.spec.kl_estimator if kl_from_policy else None, terms=loss_inputs)
        if self.spec.beta > 0:
            policy.reference()  # built now, from the untrained weights (a frozen copy without LoRA)
        params = list(policy.trainable_parameters())
        policy.model = self._prepare(policy.model, params)
        self.stat_tracker = algos.PerPromptStatTracker(self.spec.stat_buffer_size, self.spec.stat_min_count)
        self.kl_ctl = algos.AdaptiveKLController(self.spec.beta, self.spec.kl_target, self.spec.kl_horizon)
        self.counters = {"nonfinite_rewards": 0, "reward_errors": 0, "skipped_steps": 0}
        self.ratio_checked = False
        self._param_dtype = params[0].dtype
        self.evaluator = evaluator
        # --async_rollouts: batches sampled ahead in a thread, from a copy of the weights (unialign.trainers.async_rollouts)
        self.rollouts = AsyncRollouts(policy, config.max_staleness, config.seed, self._sample_groups,
                                      rank=self.acc.process_index) if config.async_rollouts else None
        self._current_job: RolloutJob | None = None

    @property
    def _old_logp_from_update(self) -> bool:
        """True when sampling need not score its samples: each batch gets exactly one optimizer step and
        no KL in the reward, so the old log-probs are the update's own, detached (after the first
        step's ratio-1 check has passed on recorded ones)."""
        spec = self.spec
        return (self.ratio_checked and spec.num_iterations == 1 and self.cfg.num_mini_batches == 1
                and not (spec.kl_in_reward and spec.beta > 0))

    # ------------------------------------------------------------------ data
    def _next_prompts(self) -> list[int]:
        """Global row indices for this step (same on every process): an epoch-seeded permutation."""
        ids = epoch_order(self.cursor, len(self.rows), self.cfg.prompts_per_step, self.cfg.seed)
        self.cursor += len(ids)
        return ids

    def _mine(self, row_ids: list[int]) -> list[int]:
        """This process's share of a step's global row ids."""
        per_proc = len(row_ids) // self.acc.num_processes
        return row_ids[self.acc.process_index * per_proc:(self.acc.process_index + 1) * per_proc]

    def _sample_groups(self, policy: Policy, row_ids: list[int], generator: torch.Generator | None = None,
                       record_logp: bool | None = None) -> Trajectory:
        """``num_generations`` samples of each of this process's share of ``row_ids`` by ``policy`` (the trained
        one, or an async rollout copy's view), drawn from ``generator`` when given."""
        G = self.cfg.num_generations
        rows = [self.rows[r] for r in self._mine(row_ids)]
        # the batch's columns: one a row lacks (GenEval's "exclude" outside counting prompts) is None there
        names = [k for k in dict.fromkeys(k for row in rows for k in row) if k != "prompt"]
        prompts, columns = [], {}
        for row in rows:
            prompts += [row["prompt"]] * G
            for k in names:
                columns.setdefault(k, []).extend([row.get(k)] * G)
        if record_logp is None:
            record_logp = not self._old_logp_from_update
        with self.autocast():  # --mixed_precision: sampled under the same autocast as trained
            traj = policy.sample(prompts, generator=generator, record_logp=record_logp)
        traj.columns = columns
        return traj

    # ------------------------------------------------------------------ phases 1-3
    def _score(self, traj: Trajectory) -> dict[str, float]:
        out = self.reward_fn(traj.prompts, traj.completions, traj.columns, on_error=self.cfg.reward_errors,
                             timeout_s=self.cfg.reward_timeout, step=self.step + 1)
        self.counters["reward_errors"] = self.counters.get("reward_errors", 0) + out.num_errors
        rewards, per_fn = out.rewards_B.double(), out.per_function  # float64 up to the advantages
        spec, cfg = self.spec, self.cfg
        cache_len = overlong_cache_tokens(spec.overlong_cache_len, cfg.max_completion_length)
        if cache_len:
            lengths = traj.mask_B_T.sum(-1)
            rewards = rewards + algos.overlong_penalty(lengths, cfg.max_completion_length, cache_len)
        traj.rewards_B = rewards
        means = {k: float(torch.nanmean(v.double())) for k, v in per_fn.items()}
        stats = {f"reward/{k}": v for k, v in means.items()}
        stats.update({f"rewards/{k}/mean": v for k, v in means.items()})  # TRL's name of each function's mean
        stats.update({f"reward/{k}": v for k, v in out.function_metrics.items()})
        return stats

    def _advantages(self, traj: Trajectory) -> dict[str, float]:
        """Fills ``traj.advantages_B_T`` (and ``ref_logp_B_T``, ``returns_B_T`` for a critic) through the
        preset's registered estimator (``unialign.algos.advantage_estimators``); returns stats."""
        spec, estimator = self.spec, self.estimator
        # float64: a group's variance of rewards ~1e20 overflows float32 and would zero every advantage
        rewards = traj.rewards_B.double()
        rewards_all = gather(rewards.to(self.acc.device)).cpu() if self.acc.num_processes > 1 else rewards
        start = self.acc.process_index * len(traj)
        if self.spec.beta > 0 and self._request.kl is None:
            traj.ref_logp_B_T = self._batched(self.policy.reference().log_prob, traj)
        mask = traj.mask_B_T
        stats: dict[str, float] = {}
        step_rewards = None
        if estimator.needs_step_rewards:  # the score at the last step, minus beta * KL_t when the KL is in the reward
            kl = algos.kl_estimate(traj.old_logp_B_T, traj.ref_logp_B_T, spec.kl_estimator).double() \
                if spec.kl_in_reward and spec.beta > 0 else torch.zeros_like(mask, dtype=torch.float64)
            step_rewards = algos.kl_shaped_rewards(torch.nan_to_num(rewards, nan=0.0), kl, mask.double(),
                                                   self.kl_ctl.value if spec.kl_in_reward else 0.0)
            if spec.kl_in_reward:
                stats.update({"kl_seq": float((kl * mask.double()).sum(-1).mean()), "kl_coef": self.kl_ctl.value})
        prompts_all = gather_object([str(p) for p in traj.prompts])
        out = estimator.fn(algos.AdvantageInputs(
            rewards_B=rewards_all, prompts=prompts_all, group_size=self.cfg.num_generations,
            rows=slice(start, start + len(traj)), mask_B_T=mask, step_rewards_B_T=step_rewards,
            values_B_T=traj.values_B_T, stat_tracker=self.stat_tracker, all_sum=self._all_sum), spec)
        adv = out.advantages_B_T.float()
        if spec.advantage_clip is not None:
            adv = adv.clamp(-spec.advantage_clip, spec.advantage_clip)
        if spec.advantage_scale != 1.0:
            adv = adv * spec.advantage_scale
        traj.advantages_B_T = adv.expand_as(mask).contiguous()
        if out.returns_B_T is not None:
            traj.returns_B_T = out.returns_B_T.float()
            stats["explained_variance"] = explained_variance(traj.values_B_T.double(), out.returns_B_T.double(),
                                                             mask.double())
        return {**stats, **out.stats}

    def _all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over processes (for estimators that normalise over the global batch)."""
        if self.acc.num_processes == 1:
            return t
        return gather(t.to(self.acc.device).unsqueeze(0)).sum(0).to(t.device)

    def _batched(self, fn: Callable, traj: Trajectory) -> torch.Tensor:
        mb = self.cfg.micro_batch_size
        with torch.no_grad():
            return torch.cat([fn(traj.select(list(range(i, min(i + mb, len(traj)))))) for i in range(0, len(traj), mb)])

    def collect(self) -> tuple[Trajectory | None, dict[str, float]]:
        """Phases 1-3: a batch of scored groups with advantages (None if no group carries signal)."""
        G, rounds, kept = self.cfg.num_generations, 0, []
        target = self.cfg.prompts_per_step // self.acc.num_processes
        n_groups = n_zero_std = n_samples = 0
        stats: dict[str, float] = {}
        t0 = time.perf_counter()
        while True:
            rounds += 1
            if self.rollouts is None:
                traj = self._sample_groups(self.policy, self._next_prompts())
            else:
                traj, waited = self._async_batch()
                stats.update(waited)
            stats.update(self._score(traj))
            r_P_G = traj.rewards_B.reshape(-1, G)
            self.counters["nonfinite_rewards"] += int((~torch.isfinite(r_P_G)).sum())
            finite = torch.where(torch.isfinite(r_P_G), r_P_G, r_P_G.nanmean(1, keepdim=True))
            zero_std = (finite.max(1).values - finite.min(1).values).abs() <= 1e-8
            n_groups, n_zero_std, n_samples = n_groups + len(zero_std), n_zero_std + int(zero_std.sum()), n_samples + len(traj)
            keep = ~zero_std if self.spec.dynamic_sampling else torch.ones_like(zero_std)
            kept += [traj.select(torch.arange(g * G, (g + 1) * G)) for g in torch.nonzero(keep).flatten().tolist()]
            have = gather(torch.tensor([len(kept)], device=self.acc.device)).min().item()
            if have >= target or rounds >= self.cfg.max_generation_rounds or not self.spec.dynamic_sampling:
                break
        num = min(target, int(have))
        stats.update({"generation_rounds": rounds, "frac_reward_zero_std": n_zero_std / max(1, n_groups),
                      "sample_seconds": time.perf_counter() - t0})
        if num == 0:
            return None, stats
        traj = Trajectory.cat(kept[:num])
        r = traj.rewards_B
        stats.update({"reward/mean": float(r.nanmean()), "reward/std": float(r[torch.isfinite(r)].std())
                      if torch.isfinite(r).sum() > 1 else 0.0,
                      "completion_length": float(traj.mask_B_T.sum(-1).mean()),
                      "truncated_frac": float(traj.truncated_B.float().mean())})
        if self.spec.mask_truncated_completions:
            traj.mask_B_T = traj.mask_B_T * (~traj.truncated_B).unsqueeze(-1).to(traj.mask_B_T.dtype)
        if self.estimator.needs_critic:
            traj.values_B_T = self._batched(lambda t: self.policy.log_prob_and_values(t)[2], traj)
        stats.update(self._advantages(traj))
        return traj, stats

    def _async_batch(self) -> tuple[Trajectory, dict[str, float]]:
        """This step's batch from the async rollouts (``unialign.trainers.async_rollouts``): every batch up to
        ``max_staleness`` steps ahead submitted with the current weights, then this one waited for. Sampled
        ``lag`` > 0 updates ago, its log-probs become the behaviour policy's (``rollout_logp_B_T``, unless an
        engine recorded its own), corrected against the current weights' by ``--rollout_correction``; the old
        log-probs are then the current weights' (the update's own when it makes one optimizer step)."""
        cfg, r = self.cfg, self.rollouts
        r.submit_through(min(self.step + cfg.max_staleness, cfg.max_steps - 1), self.step, self._next_prompts,
                         not self._old_logp_from_update)
        job, traj, waited = r.next()
        self._current_job = job
        lag = self.step - job.version
        if lag > 0:
            if traj.rollout_logp_B_T is None:
                traj.rollout_logp_B_T = traj.old_logp_B_T
            traj.old_logp_B_T = None
            if not self._old_logp_from_update:
                traj.old_logp_B_T = self._batched(self.policy.log_prob, traj) * traj.mask_B_T
        return traj, {"async/lag": float(lag), "async/wait_seconds": waited}

    # ------------------------------------------------------------------ phase 4
    def _micro_batches(self, idx: torch.Tensor) -> list[torch.Tensor]:
        return list(idx.split(self.cfg.micro_batch_size))

    def _step_chunks(self, mb: Trajectory) -> list[torch.Tensor | None]:
        """The policy's split of a micro-batch's trained steps (``step_chunks``, e.g. a diffusion policy's
        ``train_chunk_size``) when the loss is a sum over steps: token-level ratios, no critic, no rollout
        correction, no loss coupling a group's samples. ``[None]``: the micro-batch in one piece."""
        if (not isinstance(self.policy, StepChunks) or self.whole_groups or self.spec.importance_sampling_level != "token"
                or self.spec.value_coef > 0 or mb.rollout_logp_B_T is not None):
            return [None]
        chunks = self.policy.step_chunks(mb.mask_B_T)
        return [None] if len(chunks) == 1 else chunks

    def _loss(self, mb: Trajectory, normalizer: torch.Tensor, value_normalizer: torch.Tensor,
              step_mask: torch.Tensor | None = None):
        """Loss of ``mb`` under the optimizer step's ``normalizer``; with ``step_mask`` (a chunk of the
        trained steps, ``_step_chunks``) only that chunk's share, aggregated against the whole mask, so the
        chunks' losses sum to the micro-batch's."""
        spec = self.spec
        full_mask = mb.mask_B_T.to(self.acc.device)
        if step_mask is not None:
            mb = dataclasses.replace(mb, mask_B_T=step_mask)
        mask = mb.mask_B_T.to(self.acc.device)
        with self.autocast():  # --mixed_precision (a no-op without it); the loss itself in float32
            out = self.policy.loss_forward(mb, self._request)
        logp, entropy, values, kl = out.logp_B_T, out.entropy_B_T, out.values_B_T, out.kl_B_T
        adv = mb.advantages_B_T.to(logp.device)
        # one optimizer step per batch: the sampling policy is the current one, as TRL / verl use
        old_logp = logp.detach() if mb.old_logp_B_T is None else mb.old_logp_B_T.to(logp.device)
        if not self.ratio_checked:
            self._check_ratio(logp.detach(), old_logp, mask)
        terms = dict(out.terms)
        old_mse = terms.pop("old_mse", None)
        group = {"group_size": self.cfg.num_generations} if self.whole_groups else {}
        loss_B_T, m = self.policy_loss(logp, old_logp, adv, mask, spec, **terms, **group)
        per_step = {k[:-4]: m.pop(k) for k in [k for k in m if k.endswith("_B_T")]}
        if self.step_diagnostics:  # sums per trajectory step, reduced by update()
            m["_steps"] = algos.step_ratio_sums(logp.detach(), old_logp, mask, per_step)
        if old_mse is not None:
            loss_B_T = loss_B_T + spec.ema_beta * old_mse * mask
            m["old_mse"] = (old_mse.detach() * mask).sum() / mask.sum().clamp(min=1)
        if mb.rollout_logp_B_T is not None:  # sampled by another engine: pi_old / pi_rollout per token
            cfg = self.cfg
            weights, rc = algos.rollout_correction(
                old_logp, mb.rollout_logp_B_T.to(logp.device), mask, cfg.rollout_correction_level,
                "truncate" if cfg.rollout_correction == "off" else cfg.rollout_correction, cfg.rollout_correction_cap)
            if cfg.rollout_correction != "off":
                loss_B_T = loss_B_T * weights.to(loss_B_T.dtype)
            m.update({f"rollout/{k}": v for k, v in rc.items()})
        if spec.beta > 0 and not spec.kl_in_reward:
            if kl is None:
                kl = algos.kl_estimate(logp, mb.ref_logp_B_T.to(logp.device), spec.kl_estimator)
            loss_B_T = loss_B_T + spec.beta * kl * mask
            m["kl"] = (kl.detach() * mask).sum() / mask.sum().clamp(min=1)
        if spec.entropy_coef:
            loss_B_T = loss_B_T - spec.entropy_coef * entropy * mask
        if step_mask is None:
            loss = algos.aggregate(loss_B_T, mask, spec.loss_type, normalizer)
        else:  # the chunk's entries, counted against the whole mask (per-sequence means stay exact)
            loss = algos.aggregate(loss_B_T * mask, full_mask, spec.loss_type, normalizer)
        if values is not None:
            vf, vm = algos.clipped_value_loss(values, mb.values_B_T.to(values.device),
                                              mb.returns_B_T.to(values.device), mask, spec.value_clip)
            value_loss = algos.aggregate(vf, mask, "token_mean", value_normalizer)
            loss = loss + spec.value_coef * value_loss
            m.update(vm)
            m["value_loss"] = value_loss.detach()
        if entropy.requires_grad or not logp.requires_grad:  # else it is a constant of the sampler (DDPO's sigma_t)
            m["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        return loss, m

    def _check_ratio(self, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> None:
        full = self._param_dtype == torch.float32 and getattr(self.cfg, "mixed_precision", "no") == "no"
        tol = self.cfg.ratio_check_tol or (1e-3 if full else 5e-2)
        gap = float(((logp - old_logp).abs() * mask).max()) if mask.any() else 0.0
        if not gap <= tol:
            raise RatioCheckError(
                f"log-probs recomputed before the first update differ from the sampling-time ones by {gap:.3g} "
                f"(tolerance {tol:g}): the policy's sample() and log_prob() disagree (dtype, dropout, "
                "position ids or padding?). Ratio-1 is required for PPO-style clipping to mean anything.")
        self.ratio_checked = True

    def update(self, traj: Trajectory) -> dict[str, float]:
        """Phase 4: ``num_iterations`` epochs of ``num_mini_batches`` optimizer steps over ``traj``."""
        spec, cfg, acc = self.spec, self.cfg, self.acc
        metrics: dict[str, list[float]] = {}
        model = self.policy.model
        model.train()
        step_sums: dict[str, torch.Tensor] = {}
        for _ in range(spec.num_iterations):
            perm = torch.randperm(len(traj))
            if self.whole_groups:  # groups in a random order, each kept whole and contiguous
                G = cfg.num_generations
                perm = (torch.randperm(len(traj) // G).unsqueeze(1) * G + torch.arange(G)).flatten()
            minis = perm.chunk(cfg.num_mini_batches) if not self.whole_groups else \
                [g.flatten() for g in perm.view(-1, cfg.num_generations).chunk(cfg.num_mini_batches)]
            for mini in minis:
                micro = self._micro_batches(mini)
                # one normaliser per optimizer step, over every micro-batch of every process
                local = sum(algos.local_normalizer(traj.mask_B_T[i], spec.loss_type, cfg.max_completion_length)
                            for i in micro)
                tokens = sum(traj.mask_B_T[i].sum() for i in micro)
                normalizer = gather(torch.stack([local, tokens]).to(acc.device).reshape(1, 2)).sum(0)
                normalizer = normalizer / acc.num_processes
                for j, idx in enumerate(micro):
                    mb = traj.select(idx)
                    chunks, mb_loss = self._step_chunks(mb), 0.0
                    for c, step_mask in enumerate(chunks):  # one backward per chunk of trained steps
                        last = j == len(micro) - 1 and c == len(chunks) - 1
                        with contextlib.nullcontext() if last else acc.no_sync(model):
                            loss, m = self._loss(mb, normalizer[0], normalizer[1], step_mask)
                            acc.backward(loss)
                        for k, v in algos.add_step_sums(step_sums, m.pop("_steps", None), m).items():
                            metrics.setdefault(k, []).append(float(v))
                        mb_loss += float(loss.detach())
                    metrics.setdefault("loss", []).append(mb_loss * len(micro))
                grad_norm = acc.clip_grad_norm_(list(self.policy.trainable_parameters()), cfg.max_grad_norm)
                grad_norm = float(grad_norm) if grad_norm is not None else math.nan
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                else:  # a non-finite loss or gradient never reaches the weights
                    self.counters["skipped_steps"] += 1
                self.optimizer.zero_grad(set_to_none=True)
                metrics.setdefault("grad_norm", []).append(grad_norm)
        self.scheduler.step()
        out = {k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in metrics.items()}
        return {**out, **algos.step_ratio_stats(step_sums)}

    # ------------------------------------------------------------------ phase 5
    def evaluate(self) -> dict[str, float]:
        """Run the ``evaluator`` (held-out metrics; ``{}`` without one) at the current step. Its numbers,
        prefixed ``eval/``, go to the trackers and into the history entry of this step (a new entry
        before the first step), so curves show them; any other value (an image grid) goes to the
        trackers as an image. An evaluator with a ``samples`` attribute (rows of prompt, completion and
        scores, set by the call: ``GreedyHeldOut``) has them written to ``<output_dir>/completions.jsonl``
        and logged to the trackers as the table ``eval/completions``, never among the numbers. Cached per
        step: asking twice runs it once. Returns the numbers."""
        if self.evaluator is None:
            return {}
        cached = self._cached_eval()
        if cached is not None:
            return cached
        self._start_trackers()
        self.policy.model.eval()
        out = self.evaluator()
        metrics = {f"eval/{k}": float(v) for k, v in out.items() if isinstance(v, numbers.Real)}
        self._record_eval(metrics, {f"eval/{k}": v for k, v in out.items() if not isinstance(v, numbers.Real)},
                          getattr(self.evaluator, "samples", None))
        return metrics

    def _extra_state(self) -> dict[str, Any]:
        extra = {"stat_tracker": self.stat_tracker.state_dict(), "kl_ctl": self.kl_ctl.state_dict()}
        if self.rollouts is not None:  # the batches sampled ahead: sampled again on resume (their weights are tensors)
            extra["async_rollouts"] = self.rollouts.state()
        return extra

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.stat_tracker.load_state_dict(state["stat_tracker"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.ratio_checked = True  # the check is for fresh runs; resumed batches may be mid-epoch
        ahead = state.get("async_rollouts") or {"submitted": self.step, "pending": []}
        if self.rollouts is not None:
            self.rollouts.load_state(ahead, not self._old_logp_from_update)
        elif ahead["pending"]:
            raise ValueError(f"the checkpoint holds {len(ahead['pending'])} batch(es) sampled ahead by async rollouts: "
                             "resume with --async_rollouts")

    def train(self) -> list[dict]:
        """``TrainerLoop.train``; the async rollout thread, if any, is stopped at the end, or on an error."""
        try:
            return super().train()
        finally:
            if self.rollouts is not None:
                self.rollouts.close()

    def train_step(self) -> dict[str, float]:
        """One iteration: phases 1-4 (sample, score, advantages, update); a step whose groups carry no
        signal is counted in ``skipped_steps``."""
        cfg, acc = self.cfg, self.acc
        t0, cursor = time.perf_counter(), self.cursor
        try:
            traj, stats = self.collect()                          # 1-3
        except RewardError as err:
            raise self._stop_on_reward_error(err, cursor) from err
        if traj is None:
            self.counters["skipped_steps"] += 1
            return stats
        stats.update(self.update(traj))                           # 4
        if isinstance(self.policy, OptimizerStepHook):  # e.g. an old policy's moving average
            self.policy.after_optimizer_step(self.step + 1)
        local = [[float(traj.mask_B_T.sum()), float(len(traj))]]
        counts = gather(torch.tensor(local, device=acc.device)).sum(0)
        seconds = time.perf_counter() - t0
        # trained trajectory steps: completion tokens of text, trained denoising steps of images
        stats.update(tokens_per_second=float(counts[0]) / seconds, samples_per_second=float(counts[1]) / seconds)
        if self.spec.kl_in_reward and "kl_seq" in stats:
            self.kl_ctl.update(stats["kl_seq"], cfg.prompts_per_step * cfg.num_generations)
        stats.update({trl: stats[ours] for ours, trl in TRL_ONLINE_NAMES.items() if ours in stats})
        return stats

    def _random_sources(self) -> dict[str, Any]:
        return {"policy": self.policy, "reward": self.reward_fn, "rollouts": self.rollouts}

    def _progress(self, stats: dict[str, Any]) -> dict[str, str]:
        return {"reward": f"{stats.get('reward/mean', math.nan):.3f}"}

    def _stop_on_reward_error(self, err: RewardError, cursor: int) -> RewardError:
        """A reward function failed (``reward_errors="raise"``): checkpoint the last finished step (single
        process; the step that failed is not counted) and return the error, saying where progress is."""
        where = ""
        if self.step > 0 and self.acc.num_processes == 1:
            if self.rollouts is None:
                self.cursor = cursor  # the failed step's prompts are drawn again on resume
            elif self._current_job is not None and self._current_job.index == self.step:
                self.rollouts.pending.appendleft(self._current_job)  # sampled again on resume, from its weights
            path = self.save_checkpoint()
            where = f"; steps 1-{self.step} are saved in {path} (fix the reward, then --resume_from_checkpoint latest)"
        return RewardError(f"{err}{where}")

    def save_curves(self) -> None:
        """``reward_curve.png`` in the output folder, panels chosen by ``curve_keys``; the training reward
        is drawn raw (faint) and smoothed."""
        if self.acc.is_main_process:
            save_curves(self.history, Path(self.cfg.output_dir) / "reward_curve.png",
                        tuple(curve_keys(self.spec, self.history)), smooth=("reward/mean",))
            save_step_ratios(self.history, Path(self.cfg.output_dir) / "step_ratios.png")  # sampler-step policies

