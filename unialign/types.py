"""Data that crosses the modality seam, and the conventions every module shares.

Shape letters (used as suffixes on tensor names everywhere in unialign):

    B  samples in a batch (trajectories, or preference pairs for PreferenceBatch)
    T  steps of a trajectory: generated tokens for a language model, denoising transitions
       x_t -> x_{t-1} for a diffusion model
    P  prompts,  G  samples per prompt (group size),  V  vocabulary,  C/H/W  latent dims

Conventions written once:

* ``logp_B_T`` is log pi(step | history). For text it is the log-softmax of the sampled token.
  For diffusion it is the Gaussian log-density of x_{t-1} given x_t, **averaged** over C,H,W
  within a step (DDPO's convention; this is why DDPO clips the ratio at 1e-4, not 0.2).
* ``mask_B_T`` is 1 for steps that are trained (completion tokens before EOS/padding; the
  sub-sampled denoising steps) and 0 elsewhere. Masked steps never contribute to a loss.
* For preference pairs the policy returns one log-likelihood per sample: text, the sum of
  completion-token log-probs; diffusion, the ELBO *surrogate* -1/2 * mean_CHW ||eps - eps_theta||^2
  at a timestep and noise shared by the two images of a pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

Tensor = torch.Tensor


def _select(value: Any, index: Tensor | list[int]) -> Any:
    """Rows ``index`` of a per-sample value (tensor with leading B, list, or dict of those)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        return value[torch.as_tensor(index, dtype=torch.long, device=value.device)]
    if isinstance(value, dict):
        return {k: _select(v, index) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        idx = index.tolist() if isinstance(index, Tensor) else list(index)
        return [value[i] for i in idx]
    raise TypeError(f"cannot select rows of a {type(value).__name__}")


def _concat(values: list[Any]) -> Any:
    first = values[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        return _cat_padded(values)
    if isinstance(first, dict):
        return {k: _concat([v[k] for v in values]) for k in first}
    if isinstance(first, (list, tuple)):
        return [x for v in values for x in v]
    raise TypeError(f"cannot concatenate values of type {type(first).__name__}")


def _cat_padded(tensors: list[Tensor]) -> Tensor:
    """Concatenate along dim 0, right-padding dim 1 with zeros when lengths differ (token batches)."""
    if tensors[0].dim() >= 2 and len({t.shape[1] for t in tensors}) > 1:
        width = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])) for t in tensors]
    return torch.cat(tensors, dim=0)


@dataclass
class Trajectory:
    """A batch of B sampled trajectories, modality-neutral.

    Fields read by the algorithms and trainers:
        prompts:      list[B] of conditions (prompt strings / captions), one per sample.
        completions:  list[B] of what a reward looks at (decoded text, or PIL images).
        mask_B_T:     float {0,1}, trained steps.
        old_logp_B_T: log-probs recorded while sampling (no grad).
        truncated_B:  bool, the sample hit the length limit (text); always False for images.
        Samples of one prompt (a GRPO group) are contiguous: the trainer lays the batch out that way.
        ref_logp_B_T, values_B_T, rewards_B, advantages_B_T, returns_B_T (the critic's targets):
                      filled in by the trainer when used.
        rollout_logp_B_T: log-probs of the engine that sampled, when it is not the trained model (vLLM,
                      a low-precision copy); the trainer re-weights the loss by old / rollout
                      (``algos.rollout_correction``). None when sampling ran on the trained model.
        columns:      dict of per-sample dataset columns (e.g. ``answer``) passed to rewards.
        payload:      modality-specific tensors the policy needs to recompute ``log_prob``
                      (token ids and attention masks; latents, timesteps, prompt embeddings).
                      Only the policy that wrote it reads it.
    Every tensor / list field has B as its leading dimension, so ``select`` and ``cat`` work
    without knowing the modality.
    """

    prompts: list[Any]
    completions: list[Any]
    mask_B_T: Tensor
    old_logp_B_T: Tensor
    truncated_B: Tensor
    payload: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    ref_logp_B_T: Tensor | None = None
    values_B_T: Tensor | None = None
    rewards_B: Tensor | None = None
    advantages_B_T: Tensor | None = None
    returns_B_T: Tensor | None = None
    rollout_logp_B_T: Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, index: Tensor | list[int]) -> Trajectory:
        """The sub-batch of rows ``index`` (order kept)."""
        return Trajectory(**{f.name: _select(getattr(self, f.name), index) for f in fields(self)})

    @staticmethod
    def cat(parts: list[Trajectory]) -> Trajectory:
        """Concatenate batches (step axes right-padded with zeros / mask 0 if lengths differ)."""
        return Trajectory(**{f.name: _concat([getattr(p, f.name) for p in parts]) for f in fields(Trajectory)})

    def replace(self, **changes: Any) -> Trajectory:
        return replace(self, **changes)


@dataclass
class PreferenceBatch:
    """B preference pairs, modality-neutral: the policy turns each side into one log-likelihood.

    prompts:  list[B] of prompts / captions.
    chosen, rejected: modality-specific payloads with leading B (token ids and masks; latents).
    margin_B: optional per-pair margin (reward models).
    payload:  anything shared by both sides (for diffusion: the timestep and noise of the pair).
    chosen_length_B: how many units the chosen log-likelihood sums over (completion tokens for text),
              to turn it into a per-unit NLL (RPO); ``None`` means 1 (the diffusion ELBO surrogate is
              already a mean).
    """

    prompts: list[Any]
    chosen: dict[str, Any]
    rejected: dict[str, Any]
    margin_B: Tensor | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    chosen_length_B: Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, index: Tensor | list[int]) -> PreferenceBatch:
        return PreferenceBatch(**{f.name: _select(getattr(self, f.name), index) for f in fields(self)})
