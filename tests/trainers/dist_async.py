"""An async-rollout GRPO run (max_staleness 1) on however many processes torchrun gives; each rank saves its
parameters and completions to ``<out>.<rank>`` (used by test_async_rollouts.py: the ranks stay in step and sample their own prompts with
their own noise)."""

from __future__ import annotations

import sys

import torch

from tests.conftest import make_tiny_lm
from unialign.text.policy import CausalLMPolicy, unwrap
from unialign.trainers import OnlineConfig, OnlineTrainer


def main(out_path: str) -> None:
    model, tok = make_tiny_lm(seed=0)
    policy = CausalLMPolicy(model, tok, max_new_tokens=8)
    rows = [{"prompt": f"{i}+{i}?"} for i in range(8)]
    cfg = OnlineConfig(algorithm="grpo", beta=0.0, num_generations=4, prompts_per_step=2, micro_batch_size=4,
                       max_steps=3, report_to="none", output_dir=out_path + ".run", learning_rate=1e-2,
                       async_rollouts=True, max_staleness=1, seed=0)
    trainer = OnlineTrainer(policy, lambda prompts, completions: [sum(map(ord, c)) % 11 / 10 for c in completions],
                            rows, cfg)
    seen, next_batch = [], trainer._async_batch

    def keep():
        traj, stats = next_batch()
        seen.append(list(traj.completions))
        return traj, stats

    trainer._async_batch = keep
    trainer.train()
    flat = {k: v.detach().clone() for k, v in unwrap(policy.model).named_parameters()}
    torch.save({"params": flat, "completions": seen, "lags": [h["async/lag"] for h in trainer.history]},
               f"{out_path}.{trainer.acc.process_index}")
    if torch.distributed.is_initialized():  # train() may have ended the group already
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
