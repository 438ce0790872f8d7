"""A checkpoint whose weights hold NaN / inf is refused at load, in one line naming its path and the first bad
tensor (instead of a sampling error steps later)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_tiny_lm
from unialign.config import UserError
from unialign.text.policy import CausalLMPolicy
from unialign.weights import check_finite, first_nonfinite


def saved_lm(path, poison=None):
    model, tok = make_tiny_lm()
    if poison is not None:
        name, value = poison
        with torch.no_grad():
            dict(model.named_parameters())[name].view(-1)[3] = value
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_text_policy_refuses_nonfinite_weights_naming_path_and_tensor(tmp_path, value):
    path = saved_lm(tmp_path / "lm", ("model.layers.1.mlp.down_proj.weight", value))
    with pytest.raises(UserError, match=rf"model '{tmp_path / 'lm'}': weight 'model.layers.1.mlp.down_proj.weight' "
                                        r"holds 1 NaN / inf values of 2048; the checkpoint is damaged") as err:
        CausalLMPolicy.from_pretrained(str(path))
    assert "\n" not in str(err.value)


def test_finite_weights_load_and_the_check_reads_buffers_in_chunks(tmp_path, monkeypatch):
    CausalLMPolicy.from_pretrained(str(saved_lm(tmp_path / "ok")), max_new_tokens=4)
    import unialign.weights as weights

    monkeypatch.setattr(weights, "CHUNK", 7)  # chunked reads find a value in any chunk
    module = torch.nn.BatchNorm1d(40)
    assert first_nonfinite(module) is None
    module.running_var[33] = math.nan
    assert first_nonfinite(module) == ("running_var", 1, 40)
    with pytest.raises(UserError, match=r"model 'x' \(value head\): weight 'running_var'"):
        check_finite(module, "x", "value head")
    ints = torch.nn.Module()
    ints.register_buffer("ids", torch.arange(3))  # integer tensors cannot hold NaN: skipped
    assert first_nonfinite(ints) is None
