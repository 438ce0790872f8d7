"""The one modality seam: the ``Policy`` protocol every trainer and algorithm sees.

A text policy (``unialign.text.CausalLMPolicy``) and a diffusion policy
(``unialign.image.DiffusionPolicy``) both implement it. Trainers never ask which one they hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from unialign.types import PreferenceBatch, Trajectory


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

    # Optional, the critic protocol (PPO's GAE): ``has_critic`` (True when the policy carries a value model)
    # and ``log_prob_and_values(trajectory) -> (logp_B_T, entropy_B_T, values_B_T)``. An advantage
    # estimator registered with ``needs_critic`` requires both (checked when the trainer starts).
    # Optional, for policies whose steps are Gaussians of a fixed variance (diffusion): ``log_prob_and_kl(
    # trajectory) -> (logp_B_T, entropy_B_T, kl_B_T)`` with the closed-form step KL to ``reference()``;
    # ``kl_estimator="gaussian"`` requires it (checked when the trainer starts).

    def save(self, path: str) -> None:
        """Write weights (or adapters) loadable by the stock library (transformers / diffusers)."""
        ...


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

    def preference_batch(self, rows: list[dict[str, Any]], *args: Any, **kwargs: Any) -> PreferenceBatch:
        return self.policy.preference_batch(rows, *args, **kwargs)

    def reference(self) -> ReferencePolicy:
        return self

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        return []

    def save(self, path: str) -> None:
        raise NotImplementedError("the reference policy is frozen; save the policy itself")
