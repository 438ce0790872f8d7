"""How a masked-diffusion LM samples: semi-autoregressive block decoding (LLaDA, Nie et al. 2025, sec. 2.4; d1's
``generate``), with Fast-dLLM's confidence-threshold parallel decoding (Wu et al. 2025, arXiv 2505.22618).

The completion block of ``gen_length`` tokens starts fully masked and is filled left to right in blocks of
``block_length``; each block gets ``steps * block_length / gen_length`` denoising steps. At each step the model
predicts every masked token of the sequence; tokens are drawn for the current block (at ``temperature``; 0:
argmax) and a scheduled number of them is committed: the most confident ones (``remasking="low_confidence"``) or
random ones (``"random"``); with ``threshold`` every token whose probability is above it is committed at once (at
least the scheduled number otherwise), and a block whose tokens are all committed ends early. ``step_map_B_T``
records the step (counted over the whole completion) at which each token was committed: TraceRL's trace. Block
length 1 with ``gen_length`` steps is left-to-right decoding (JustGRPO's order).

The commit rule is diffusers' ``BlockRefinementScheduler`` (its ``step``: sample, rank by confidence, commit the
scheduled number or everything above the threshold); random remasking, which that scheduler has not, is written
here. diffusers' ``LLaDA2Pipeline`` runs LLaDA-2's own cached model class, not an arbitrary masked LM, so the loop
around the scheduler is ours (``benchmarks/dlm_sampling.py`` compares the two where the pipeline runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

REMASKING = ("low_confidence", "random")


@dataclass(frozen=True)
class DiffusionSampling:
    """One masked-diffusion policy's sampling settings (checked on construction: a ValueError names the knob)."""

    gen_length: int = 32                  # completion block in tokens (EOS fills it after the answer)
    block_length: int = 8                 # semi-autoregressive block; gen_length: one block; 1: left to right
    steps: int = 16                       # denoising steps over the whole completion (forward passes, at most)
    remasking: str = "low_confidence"     # which tokens a step commits: the most confident, or random ones
    temperature: float = 1.0              # of the token draws when sampling (greedy evaluation: argmax)
    threshold: float | None = None        # Fast-dLLM: commit every token above this probability (None: off)

    def __post_init__(self) -> None:
        checks = {"gen_length": self.gen_length >= 1, "block_length": 1 <= self.block_length <= self.gen_length
                  and self.gen_length % self.block_length == 0,
                  "steps": self.steps >= self.gen_length // self.block_length and self.steps <= self.gen_length
                  and self.steps % (self.gen_length // self.block_length) == 0,
                  "remasking": self.remasking in REMASKING, "temperature": self.temperature >= 0,
                  "threshold": self.threshold is None or 0 < self.threshold <= 1}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"diffusion sampling: {name}={getattr(self, name)!r} is out of range (block_length divides "
                    f"gen_length; steps a multiple of the {self.gen_length // max(1, self.block_length)} blocks, "
                    f"at most gen_length; remasking one of {REMASKING}; temperature >= 0; 0 < threshold <= 1)")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def with_(self, **changes: Any) -> DiffusionSampling:
        return replace(self, **changes)


#: ``logits(completion_B_T) -> [B, T, V]``: the model's logits at the completion positions for the current
#: (partly masked) completion, the prompt fixed (the policy's forward, target alignment applied).
Logits = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def block_decode(logits_fn: Logits, batch_size: int, mask_id: int, knobs: DiffusionSampling, greedy: bool = False,
                 device: torch.device | str = "cpu",
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sample completions [B, gen_length] by block decoding; returns (completion ids, step_map [B, T] long, the
    number of forward passes run). ``greedy``: argmax draws, low-confidence commits (held-out evaluation)."""
    from diffusers import BlockRefinementScheduler

    T, L = knobs.gen_length, knobs.block_length
    x = torch.full((batch_size, T), mask_id, dtype=torch.long, device=device)
    step_map = torch.full((batch_size, T), -1, dtype=torch.long, device=device)
    temperature = 0.0 if greedy else knobs.temperature
    remasking = "low_confidence" if greedy else knobs.remasking
    scheduler = BlockRefinementScheduler(block_length=L, num_inference_steps=knobs.steps_per_block,
                                         threshold=knobs.threshold or 1.0, minimal_topk=1)
    scheduler.set_timesteps(knobs.steps_per_block, device=device, block_length=L)
    schedule = scheduler.get_num_transfer_tokens(L, knobs.steps_per_block)
    step = forwards = 0
    for block in range(knobs.num_blocks):
        lo, hi = block * L, (block + 1) * L
        i = 0
        while bool((x[:, lo:hi] == mask_id).any()):
            logits = logits_fn(x)[:, lo:hi].float()
            forwards += 1
            sample = x[:, lo:hi]
            k = int(schedule[i]) if i < len(schedule) else L  # past the schedule (never, by its sum): all left
            if remasking == "low_confidence":
                # threshold 1.0 never fires (a probability is never above 1): the scheduled top-k only
                out = scheduler.step(logits, min(i, len(schedule) - 1), sample, mask_token_id=mask_id,
                                     temperature=temperature,
                                     threshold=knobs.threshold if knobs.threshold is not None else 1.0,
                                     generator=generator)
                commit = out.transfer_index
                if i >= len(schedule):  # every remaining token now
                    commit = sample == mask_id
                new = torch.where(commit, out.sampled_tokens, sample)
            else:
                new, commit = _random_commit(logits, sample, mask_id, k, temperature, generator)
            step_map[:, lo:hi] = torch.where(commit & (step_map[:, lo:hi] < 0), step, step_map[:, lo:hi])
            x[:, lo:hi] = new
            step += 1
            i += 1
    return x, step_map, forwards


def _random_commit(logits: torch.Tensor, sample: torch.Tensor, mask_id: int, k: int, temperature: float,
                   generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA's random remasking: draw every masked token, commit k random masked positions per row."""
    probs = torch.softmax(logits / max(temperature, 1e-6), dim=-1) if temperature > 0 else None
    if probs is None:
        tokens = logits.argmax(-1)
    else:
        flat = probs.reshape(-1, probs.shape[-1])
        tokens = torch.multinomial(flat, 1, generator=generator).view(sample.shape)
    masked = sample == mask_id
    score = torch.rand(sample.shape, generator=generator, device=sample.device).masked_fill(~masked, -1.0)
    k_B = masked.sum(-1).clamp(max=k)
    ranks = score.argsort(-1, descending=True).argsort(-1)
    commit = masked & (ranks < k_B.unsqueeze(-1))
    return torch.where(commit, tokens, sample), commit
