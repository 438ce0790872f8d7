"""Run one trainer update on a fixed batch, on however many processes torchrun gives; rank 0 saves params.

Used by test_online.py to check that 1 and 2 processes give the same weights for the same global batch.
"""

from __future__ import annotations

import os
import sys

import torch

from tests.conftest import make_tiny_lm
from unialign.text.policy import CausalLMPolicy, unwrap
from unialign.trainers import OnlineConfig, OnlineTrainer


def main(out_path: str, loss_types: str) -> None:
    """One update per loss type (comma-separated); saves {loss_type: gradients} from rank 0."""
    results = {lt: one_update(lt) for lt in loss_types.split(",")}
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        torch.save(results, out_path)
    if torch.distributed.is_initialized():  # an orderly gloo shutdown (else a rank can abort at exit)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def one_update(loss_type: str) -> dict:
    model, tok = make_tiny_lm(seed=0)
    policy = CausalLMPolicy(model, tok, max_new_tokens=8)
    cfg = OnlineConfig(algorithm="grpo", beta=0.0, loss_type=loss_type, num_generations=4, prompts_per_step=2,
                       micro_batch_size=2, report_to="none", output_dir="/tmp/unialign-dist", learning_rate=1e-2,
                       max_completion_length=8)
    trainer = OnlineTrainer(policy, lambda prompts, completions: [0.0] * len(completions), [{"prompt": "x"}], cfg)
    torch.manual_seed(123)  # the same global batch on every rank
    traj = policy.sample(["1+2?"] * 4 + ["a longer prompt 40+2?"] * 4)
    traj.advantages_B_T = torch.linspace(-1.5, 2.0, 8).unsqueeze(-1).expand_as(traj.mask_B_T).contiguous()
    n, rank = trainer.acc.num_processes, trainer.acc.process_index
    assert n == int(__import__("os").environ.get("WORLD_SIZE", "1")), "accelerate does not see the launched processes"
    per = len(traj) // n
    grads = {}
    named = list(unwrap(policy.model).named_parameters())
    trainer.optimizer.step = lambda *a, **k: grads.update({n: p.grad.detach().clone() for n, p in named})
    trainer.update(traj.select(list(range(rank * per, (rank + 1) * per))))
    return grads  # after DDP's all-reduce, as the optimizer sees them


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # The results are written; skip the interpreter's teardown, where a C++ thread of the process group or of
    # the CPU runtime occasionally still runs and aborts the rank ("terminate called without an active exception",
    # exit -6), failing the launch after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
