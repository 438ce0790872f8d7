"""What a policy needs to know about the processes it runs in: the wrappers around its module, which process
writes files, and FSDP2's sharded parameters (gathered for saving, held unsharded around calls that skip the
root module's forward)."""

from __future__ import annotations

import contextlib

import torch


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP-style wrappers (anything exposing ``.module``), keeping PEFT wrappers."""
    while isinstance(module, torch.nn.parallel.DistributedDataParallel) or type(module).__name__ in (
        "DistributedDataParallel", "DeepSpeedEngine", "FullyShardedDataParallel"):
        module = module.module
    return module


def is_main_rank() -> bool:
    """True on the process that writes files (rank 0, or the only process)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def gathered_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as full, detached CPU tensors: FSDP2's DTensor shards are all-gathered (a
    collective: every process must call it, in the same order)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in module.state_dict().items()}


def fsdp2_root(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` when it is sharded by FSDP2 (``fully_shard``), else None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    return model if isinstance(model, FSDPModule) else None


@contextlib.contextmanager
def gathered_fsdp2_root(model: torch.nn.Module):
    """Hold an FSDP2 root's own parameters unsharded for the duration (its submodules unshard themselves in
    their forwards); no-op otherwise. The root is initialised first, as its first forward would do."""
    root = fsdp2_root(model)
    if root is None:
        yield
        return
    root._get_fsdp_state()._lazy_init()  # private, but what the root's first forward runs
    root.unshard()
    try:
        yield
    finally:
        root.reshard()
