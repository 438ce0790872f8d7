"""The one modality seam: the ``Policy`` protocol every trainer and algorithm sees, and the optional
capabilities a policy declares beside it.

A text policy (``unialign.text.CausalLMPolicy``), a vision-language one and the diffusion policies
(``unialign.image.DiffusionPolicy``, the flow-matching ones) all implement ``Policy``. Trainers never ask which
one they hold; they ask for what a loss needs in one call, ``loss_forward(trajectory, LossRequest(...))``, which
returns a ``LossForward`` (log-probs, entropy, and the values, KL and extra terms asked for). What a policy can
give beyond log-probs and entropy it declares by subclassing the capability protocols below (a policy class
lists them among its bases; ``isinstance`` then answers the trainer, which checks them once, when it starts):

    Critic              ``has_critic`` and ``log_prob_and_values``: PPO's value model (GAE)
    ClosedFormKL        ``closed_form_kls`` and ``log_prob_and_kl``: the exact per-step KL to ``reference()``
    KLWeights           ``kl_weights``: the per-step weights of Flow-GRPO's KL (``gaussian_g2``)
    LossTerms           ``log_prob_terms``: the extra per-step terms a registered policy loss reads (NFT's)
    StepChunks          ``step_chunks``: a micro-batch's trained steps in chunks, one backward each (memory)
    OptimizerStepHook   ``after_optimizer_step``: work after each optimizer step (an old policy's average)
    StepStatistics      ``per_step_diagnostics``: whether step t is the same step for every sample (a sampler's
                        denoising steps), so the importance ratio's statistics per step mean something
    SamplingCopy        ``sampling_view(model)``: the policy sampling from a frozen copy of its weights, callable
                        from another thread (async rollouts, ``unialign.trainers.async_rollouts``)

``PolicyBase`` gives a policy ``loss_forward`` built from the capabilities it declares, and the default
``log_prob_estimator`` ("sampler": the sampler's own step or token densities).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from unialign import algos
from unialign.types import PreferenceBatch, Trajectory


@dataclass(frozen=True)
class LossRequest:
    """What a loss needs from the policy's forward over a trajectory, beyond log-probs and entropy."""

    values: bool = False          # the critic's values (PPO's value loss): a ``Critic``
    kl: str | None = None         # a closed-form KL estimator (``algos.CLOSED_FORM_ESTIMATORS``): a ``ClosedFormKL``
    terms: tuple[str, ...] = ()   # the per-step terms a registered policy loss reads (``fn.inputs``): ``LossTerms``


@dataclass
class LossForward:
    """One forward's answer to a ``LossRequest``: every tensor [B, T], 0 where masked."""

    logp_B_T: torch.Tensor
    entropy_B_T: torch.Tensor
    values_B_T: torch.Tensor | None = None   # when ``values`` was asked
    kl_B_T: torch.Tensor | None = None       # when ``kl`` was asked: that estimator's per-step KL to the reference
    terms: dict[str, Any] = field(default_factory=dict)  # when ``terms`` were asked, by name


# ----------------------------------------------------------------------------------- optional capabilities
@runtime_checkable
class Critic(Protocol):
    """A policy with a value model: ``has_critic`` (whether this instance carries one) and
    ``log_prob_and_values(trajectory) -> (logp_B_T, entropy_B_T, values_B_T)``. An advantage estimator registered
    with ``needs_critic`` requires one."""

    @property
    def has_critic(self) -> bool: ...

    def log_prob_and_values(self, trajectory: Trajectory) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class ClosedFormKL(Protocol):
    """A policy whose steps are Gaussians of a fixed variance (diffusion): ``log_prob_and_kl(trajectory) ->
    (logp_B_T, entropy_B_T, kl_B_T)`` with the closed-form per-step KL to ``reference()``, for the estimators
    ``closed_form_kls`` names."""

    @property
    def closed_form_kls(self) -> tuple[str, ...]: ...

    def log_prob_and_kl(self, trajectory: Trajectory) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class KLWeights(Protocol):
    """``kl_weights(trajectory) -> [B, T]``: the per-step weights of the KL estimators in
    ``algos.NEEDS_KL_WEIGHTS`` (Flow-GRPO's ``gaussian_g2``: std^2 / g^2 of each step)."""

    def kl_weights(self, trajectory: Trajectory) -> torch.Tensor: ...


@runtime_checkable
class LossTerms(Protocol):
    """``log_prob_terms(trajectory, names, with_kl) -> (logp_B_T, entropy_B_T, kl_B_T or None, {name: term})``:
    the extra per-step terms a registered policy loss reads, in the log-probs' own model call;
    ``prepare_terms(names)``, called once by the trainer before it samples: record at sampling what those terms
    need (a flow policy's step means), ValueError for a term the policy does not offer."""

    def prepare_terms(self, names: tuple[str, ...]) -> None:
        ...

    def log_prob_terms(self, trajectory: Trajectory, names: tuple[str, ...],
                       with_kl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        ...


@runtime_checkable
class StepChunks(Protocol):
    """``step_chunks(mask_B_T) -> [mask_B_T, ...]``: the trained steps of a micro-batch split into {0, 1} masks
    that sum to it; the trainer computes each chunk's share of the loss with its own backward."""

    def step_chunks(self, mask_B_T: torch.Tensor) -> list[torch.Tensor]: ...


@runtime_checkable
class OptimizerStepHook(Protocol):
    """``after_optimizer_step(step)``: called by the trainer after optimizer step ``step`` (1-based)."""

    def after_optimizer_step(self, step: int) -> None: ...


@runtime_checkable
class StepStatistics(Protocol):
    """``per_step_diagnostics``: True when a trajectory's step t is the same step for every sample (a sampler's
    denoising steps, not token positions); the trainer then logs the importance ratio's mean, spread and clip
    fraction per step (``unialign.algos.diagnostics``)."""

    @property
    def per_step_diagnostics(self) -> bool: ...


@runtime_checkable
class SamplingCopy(Protocol):
    """``sampling_view(model) -> Policy``: this policy sampling from ``model``, a frozen copy of its trained module
    whose weights the caller refreshes, sharing nothing mutable with the trained policy (its own tokenizer,
    caches and rollout engine), so that it samples in a background thread while the trainer updates. Its
    ``sample`` must draw every random number from the ``generator`` it is given (none from torch's global RNG,
    which the trainer draws from concurrently) and record the copy's log-probs. ValueError when an option of
    this policy rules it out (naming the option)."""

    def sampling_view(self, model: torch.nn.Module) -> Policy: ...


@runtime_checkable
class Policy(Protocol):
    """What a trainable generative model offers to the algorithms.

    model:  the ``nn.Module`` holding every trainable parameter. Trainers may replace it with a
            wrapped version (DDP / FSDP via accelerate); the policy must work through the wrapper.
    """

    model: torch.nn.Module

    def sample(self, prompts: list[Any], generator: torch.Generator | None = None,
               record_logp: bool = True) -> Trajectory:
        """Sample one trajectory per prompt (repeat prompts for groups), recording
        ``old_logp_B_T`` and ``mask_B_T``; no gradients. With ``record_logp=False`` a policy whose
        log-probs cost an extra forward may leave ``old_logp_B_T`` None: the trainer asks so only when
        the batch gets exactly one optimizer step, where old log-probs equal the first forward's, detached."""
        ...

    def log_prob(self, trajectory: Trajectory) -> torch.Tensor:
        """Differentiable ``logp_B_T`` of the recorded steps (0 where masked). On the first on-policy
        call it equals ``trajectory.old_logp_B_T``."""
        ...

    def log_prob_and_entropy(self, trajectory: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp_B_T, entropy_B_T)``: ``log_prob`` and the per-step entropy of the policy's step
        distribution (text: the next-token distribution; diffusion: the step Gaussian, a constant)."""
        ...

    def reference(self) -> Policy:
        """The frozen reference policy: the same model with adapters disabled when LoRA is on,
        else a frozen copy. Its ``log_prob`` runs without gradients."""
        ...

    def preference_batch(self, rows: list[dict[str, Any]]) -> PreferenceBatch:
        """Turn normalised pairs (``prompt``, ``chosen``, ``rejected``) into model inputs: tokenised
        text, or VAE latents with the pair's shared timestep and noise in ``payload``."""
        ...

    def sequence_log_prob(self, batch: PreferenceBatch, length_normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen_B, rejected_B) log-likelihoods of a preference batch (text: sum of token
        log-probs, or their mean with ``length_normalize`` for IPO; diffusion: the ELBO surrogate with
        shared t and noise per pair, already a mean)."""
        ...

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]: ...

    #: what ``log_prob`` estimates: "sampler" (the sampler's own densities) or "forward" (a forward-process
    #: surrogate at fresh noise); an algorithm's ``log_prob_estimator`` must match it
    log_prob_estimator: str

    def loss_forward(self, trajectory: Trajectory, request: LossRequest) -> LossForward:
        """Everything a loss needs from one forward over ``trajectory``: the log-probs and entropy, and what
        ``request`` asks for (a policy that declares the capability it needs; ``PolicyBase`` builds it)."""
        ...

    def save(self, path: str) -> None:
        """Write weights (or adapters) loadable by the stock library (transformers / diffusers)."""
        ...


class PolicyBase:
    """What every policy shares: ``loss_forward`` answered from the capabilities its class declares (one model
    call for each request: values with the log-probs, the KL with the log-probs, the extra terms with both), and
    the ``log_prob_estimator`` "sampler" (a denoiser on the forward process overrides it)."""

    log_prob_estimator = "sampler"

    def loss_forward(self, trajectory: Trajectory, request: LossRequest) -> LossForward:
        """``Policy.loss_forward``. The trainer checked at its start that the policy declares the capabilities
        ``request`` needs."""
        if request.values:
            logp, entropy, values = self.log_prob_and_values(trajectory)
            return LossForward(logp, entropy, values_B_T=values)
        if request.terms:
            logp, entropy, kl, terms = self.log_prob_terms(trajectory, request.terms, with_kl=request.kl is not None)
            return LossForward(logp, entropy, kl_B_T=self._closed_form_kl(kl, trajectory, request.kl), terms=terms)
        if request.kl is not None:
            logp, entropy, kl = self.log_prob_and_kl(trajectory)
            return LossForward(logp, entropy, kl_B_T=self._closed_form_kl(kl, trajectory, request.kl))
        logp, entropy = self.log_prob_and_entropy(trajectory)
        return LossForward(logp, entropy)

    def _closed_form_kl(self, kl: torch.Tensor | None, trajectory: Trajectory, estimator: str | None) -> Any:
        """The policy's raw per-step KL as ``estimator`` reads it (weighted by ``kl_weights`` where it needs)."""
        if kl is None:
            return None
        weights = self.kl_weights(trajectory) if estimator in algos.NEEDS_KL_WEIGHTS else None
        return algos.closed_form_kl(kl, estimator, weights)


class ReferencePolicy:
    """The frozen reference of a policy, for text and images alike: the same interface, no gradients, run on
    ``model`` (a frozen copy, or None: the policy's own, possibly wrapped, module) inside ``context()``
    (adapters disabled; nothing for a frozen copy).

    A policy offers it by implementing the model-explicit forms of its methods, which its own public methods
    call with ``self.model``: ``_log_prob(model, trajectory, with_entropy)`` (a tensor, or the pair with
    ``with_entropy``), ``_sequence_log_prob(model, batch, length_normalize)`` and, to sample from the
    reference, ``_sample(model, prompts, generator)``."""

    def __init__(self, policy: Any, model: torch.nn.Module | None = None,
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        self.policy, self._model, self._context = policy, model, context

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model if self._model is None else self._model

    @contextlib.contextmanager
    def _frozen(self) -> Iterator[None]:
        with torch.no_grad(), self._context():
            yield

    def sample(self, prompts: list[Any], generator: torch.Generator | None = None,
               record_logp: bool = True) -> Trajectory:
        with self._frozen():
            return self.policy._sample(self.model, prompts, generator)

    def log_prob(self, trajectory: Trajectory) -> torch.Tensor:
        with self._frozen():
            return self.policy._log_prob(self.model, trajectory, False)

    def log_prob_and_entropy(self, trajectory: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
        with self._frozen():
            return self.policy._log_prob(self.model, trajectory, True)

    def sequence_log_prob(self, batch: PreferenceBatch, length_normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with self._frozen():
            return self.policy._sequence_log_prob(self.model, batch, length_normalize)

    @property
    def log_prob_estimator(self) -> str:
        return self.policy.log_prob_estimator

    def loss_forward(self, trajectory: Trajectory, request: LossRequest) -> LossForward:
        """Log-probs and entropy, frozen: a reference is scored, never trained, so it answers no other request."""
        if request != LossRequest():
            raise ValueError(f"the reference policy answers log-probs and entropy only, not {request}")
        return LossForward(*self.log_prob_and_entropy(trajectory))

    def preference_batch(self, rows: list[dict[str, Any]], *args: Any, **kwargs: Any) -> PreferenceBatch:
        return self.policy.preference_batch(rows, *args, **kwargs)

    def reference(self) -> ReferencePolicy:
        return self

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        return []

    def save(self, path: str) -> None:
        raise NotImplementedError("the reference policy is frozen; save the policy itself")
