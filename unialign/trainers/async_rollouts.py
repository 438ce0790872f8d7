"""Async rollouts: the next batches are sampled in a background thread, on a copy of the weights that lags the
trained ones by ``max_staleness`` optimizer steps at most, while the trainer updates (``OnlineConfig.async_rollouts``).

The schedule is fixed, so that a run reproduces and resumes exactly whatever the threads' timing: batch ``b``
(trained by update ``b``) is sampled from the weights after update ``b - k`` (``k = max_staleness``; the first ``k``
batches from the initial weights). Before update ``u`` the trainer submits every batch up to ``u + k`` with the
current weights (a copy of the trainable parameters, taken then) and waits for batch ``u``. ``k = 0`` is the
synchronous loop through the same machinery: the trainer waits for each batch as soon as it submits it.

Randomness: with ``k > 0`` batch ``b`` draws from its own ``torch.Generator`` seeded by (``seed``, ``b``, the process), never
from torch's global RNG, which the trainer draws from at the same time (mini-batch order, the evaluation's
preserved RNG); the policy's ``sampling_view`` promises it (``unialign.policy.SamplingCopy``). With ``k = 0``
nothing runs beside the sampling, which draws from the global RNG exactly as the synchronous loop does: the
same run, bit for bit.

Off-policy correction: a batch sampled ``lag > 0`` updates ago keeps the copy's log-probs as the behaviour
policy's (``Trajectory.rollout_logp_B_T``; a text policy's are those its decoding computed, as an inference
engine's, with no scoring forward in the thread); the trainer's old log-probs are the current weights' (the update's
own when the batch gets one optimizer step), and the loss is re-weighted by old / behaviour through
``algos.rollout_correction`` (``--rollout_correction``: TIS truncation or MIS masking, the decoupled objective of
AReaL, Fu et al. 2025), which keeps async runs from collapsing (NeMo-RL #1098).

Checkpoints: the batches submitted and not yet trained are written as their row ids, batch index, weight
version and the trainable weights they are sampled from (``state_tensors``), and sampled again on resume from
the same weights with the same generator: the same batches.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from unialign.dist import unwrap
from unialign.policy import SamplingCopy
from unialign.types import Trajectory


@dataclass
class RolloutJob:
    """One batch to sample: ``index`` (the update that trains it), the global ``row_ids`` of its prompts, the
    ``version`` of its weights (optimizer updates they have seen) and those weights (the trainable parameters,
    by the unwrapped module's names)."""

    index: int
    row_ids: list[int]
    version: int
    weights: dict[str, torch.Tensor]
    future: Future | None = None


def rollout_seed(seed: int, index: int, rank: int = 0) -> int:
    """The generator seed of batch ``index`` on process ``rank`` in a run seeded ``seed`` (distinct per batch and
    process, in int64)."""
    return (seed * 1_000_003 + index * 7_919 + rank * 104_729 + 1) % (2 ** 63)


class AsyncRollouts:
    """Samples batches of ``policy`` in one background thread, from a frozen copy of its trained module.

    ``sample(view, row_ids, generator, record_logp) -> Trajectory`` is the trainer's sampling of one batch from
    a policy (``view``: this copy's ``sampling_view``); ``staleness`` is ``max_staleness``; ``seed`` and ``rank`` (this
    process's index) seed the batches' generators."""

    def __init__(self, policy: Any, staleness: int, seed: int,
                 sample: Callable[[Any, list[int], torch.Generator | None, bool], Trajectory], rank: int = 0):
        if not isinstance(policy, SamplingCopy):
            raise ValueError(f"async_rollouts: {type(policy).__name__} cannot sample from a copy of its weights "
                             "(no sampling_view, unialign.policy.SamplingCopy); turn async_rollouts off")
        if staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {staleness}")
        trained = unwrap(policy.model)
        self.model = copy.deepcopy(trained).eval().requires_grad_(False)
        self.view = policy.sampling_view(self.model)  # ValueError naming the option that rules it out
        names = {id(p): n for n, p in trained.named_parameters()}
        self._trainable = [(names[id(p)], p) for p in policy.trainable_parameters() if id(p) in names]
        self._copy_params = dict(self.model.named_parameters())
        self.staleness, self.seed, self.rank, self._sample = staleness, seed, rank, sample
        self.device = next(trained.parameters()).device
        self.pending: deque[RolloutJob] = deque()
        self.submitted = 0  # batches submitted so far: the next one's index
        self._executor: ThreadPoolExecutor | None = None
        self._loaded: dict[str, torch.Tensor] = {}  # a checkpoint's pending weights, until ``load_state``

    # ------------------------------------------------------------------ the schedule
    def submit_through(self, last: int, version: int, next_rows: Callable[[], list[int]],
                       record_logp: bool) -> None:
        """Submit every batch up to index ``last`` not yet submitted, with the current weights (``version``
        updates old) and the prompts ``next_rows()`` draws for each; a batch that will be trained by the
        weights it is sampled from (``index == version``) records log-probs only if ``record_logp``."""
        while self.submitted <= last:
            weights = {n: p.detach().clone() for n, p in self._trainable}
            job = RolloutJob(self.submitted, next_rows(), version, weights)
            self.submitted += 1
            self._start(job, record_logp or job.index != version)

    def next(self) -> tuple[RolloutJob, Trajectory, float]:
        """The oldest submitted batch, waited for: (its job, the trajectory, seconds waited)."""
        job = self.pending.popleft()
        t0 = time.perf_counter()
        traj = job.future.result()  # an exception in the thread is raised here
        return job, traj, time.perf_counter() - t0

    def _start(self, job: RolloutJob, record_logp: bool) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="unialign-rollouts")
        job.future = self._executor.submit(self._run, job, record_logp)
        self.pending.append(job)

    @torch.no_grad()
    def _run(self, job: RolloutJob, record_logp: bool) -> Trajectory:
        for name, value in job.weights.items():
            self._copy_params[name].copy_(value)
        generator = None
        if self.staleness > 0:  # the trainer runs meanwhile: draw from this batch's own generator
            generator = torch.Generator(device=self.device).manual_seed(rollout_seed(self.seed, job.index, self.rank))
        return self._sample(self.view, job.row_ids, generator, record_logp)

    def close(self) -> None:
        """Stop the thread (batches not yet started are dropped); the next submission starts another."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """The schedule, for the trainer state (JSON): batches submitted, and each pending batch's index, rows
        and weight version (its weights are ``state_tensors``)."""
        return {"submitted": self.submitted,
                "pending": [{"index": j.index, "row_ids": j.row_ids, "version": j.version} for j in self.pending]}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The pending batches' weights, ``"<index>.<parameter>"``."""
        return {f"{j.index}.{n}": t for j in self.pending for n, t in j.weights.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._loaded = tensors

    def load_state(self, state: dict[str, Any], record_logp: bool) -> None:
        """Resume: the pending batches submitted again, each from the weights it was sampled from (read by
        ``load_state_tensors`` first), in order."""
        self.close()
        self.pending.clear()
        tensors = self._loaded
        for j in state["pending"]:
            prefix = f"{j['index']}."
            weights = {k[len(prefix):]: v.to(self.device) for k, v in tensors.items() if k.startswith(prefix)}
            if set(weights) != {n for n, _ in self._trainable}:
                raise ValueError(f"the checkpoint's async rollout batch {j['index']} lacks the weights it was "
                                 "sampled from; resume with the max_staleness it was written with")
            job = RolloutJob(j["index"], list(j["row_ids"]), j["version"], weights)
            self._start(job, record_logp or job.index != job.version)
        self.submitted = state["submitted"]
        self._loaded = {}
