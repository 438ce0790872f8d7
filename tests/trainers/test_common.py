"""Optimizer choice shared by both loops."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from unialign.trainers.schedule import make_optimizer
from unialign.trainers.train_config import TrainConfig


def _fit(optim: str) -> float:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 4))
    opt, _ = make_optimizer([w], TrainConfig(optim=optim, learning_rate=1e-2, max_steps=50))
    target = torch.zeros(8, 4)
    for _ in range(50):
        loss = ((w - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(((w - target) ** 2).mean())


def test_adafactor_is_available_and_optimises():
    opt, _ = make_optimizer([torch.nn.Parameter(torch.zeros(2, 2))], TrainConfig(optim="adafactor"))
    assert isinstance(opt, torch.optim.Adafactor) and opt.param_groups[0]["lr"] == TrainConfig.learning_rate
    start = float((torch.randn(8, 4, generator=torch.Generator().manual_seed(0)) ** 2).mean())
    assert _fit("adafactor") < 0.5 * start


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes installed")
def test_8bit_adam_without_bitsandbytes_says_what_to_install():
    with pytest.raises(ValueError, match="pip install bitsandbytes"):
        make_optimizer([torch.nn.Parameter(torch.zeros(2))], TrainConfig(optim="adamw_8bit"))


def test_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match="optim: unknown optimizer 'sgd'"):
        make_optimizer([torch.nn.Parameter(torch.zeros(2))], TrainConfig(optim="sgd"))


def test_check_launch_refuses_unseen_processes_and_deepspeed(monkeypatch):
    """torchrun on a CPU machine without ACCELERATE_USE_CPU gives accelerate 1 process per rank: every
    rank would train alone. DeepSpeed would step its optimizer inside every backward."""
    from types import SimpleNamespace

    import pytest

    from unialign.trainers.launch import check_launch

    plain = SimpleNamespace(num_processes=1, state=SimpleNamespace(deepspeed_plugin=None))
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_launch(plain)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="ACCELERATE_USE_CPU"):
        check_launch(plain)
    two = SimpleNamespace(num_processes=2, state=SimpleNamespace(deepspeed_plugin=None))
    check_launch(two)
    with pytest.raises(RuntimeError, match="DeepSpeed"):
        check_launch(SimpleNamespace(num_processes=2, state=SimpleNamespace(deepspeed_plugin=object())))
