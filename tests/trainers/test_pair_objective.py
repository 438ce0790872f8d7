"""The pair objective looks its loss up in the registry: reference-free SimPO / ORPO build, load and run no
reference (no second copy of the weights, no reference forward) and learn; the DPO family is unchanged."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import make_tiny_lm
from tests.helpers import assert_close
from unialign.text.policy import CausalLMPolicy
from unialign.trainers.preference import (
    DPOObjective,
    PairObjective,
    PreferenceConfig,
    PreferenceTrainer,
    averaged_implicit_accuracy,
)

PAIRS = [{"prompt": f"{a}+{a}?", "chosen": f"{2 * a}", "rejected": f"{2 * a + 1}"} for a in range(10, 26)]
ROWS = [{"prompt": "3+4?", "chosen": "7", "rejected": "eight"}, {"prompt": "5+5?", "chosen": "ten", "rejected": "9"}]


def perturbed_policy() -> tuple[CausalLMPolicy, torch.nn.Module]:
    model, tok = make_tiny_lm()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return CausalLMPolicy(model, tok), model


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in the process (parameters included)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:  # fake / functional tensors left by torch.compile elsewhere in the suite have no storage
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
    return sum(storages.values())


def test_dpo_objective_is_the_pair_objective():
    assert DPOObjective is PairObjective


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_build_and_run_no_reference(loss_type, monkeypatch):
    policy, model = perturbed_policy()

    def no_reference():
        raise AssertionError("a reference-free loss asked for a reference")

    monkeypatch.setattr(policy, "reference", no_reference)
    obj = PairObjective(policy, beta=2.0, loss_type=loss_type)
    assert obj.reference is None
    batch = policy.preference_batch(ROWS)
    calls = []
    hook = model.register_forward_hook(lambda m, a, k, out: calls.append(k["input_ids"].shape[0]), with_kwargs=True)
    losses, metrics = obj.losses(batch)
    hook.remove()
    assert calls == [2, 4]  # the policy's one pass (2 prompts, then the 2B completions); no reference pass
    assert losses.shape == (2,) and torch.isfinite(losses).all()
    assert not any(k.startswith("ref_logps") for k in metrics)
    obj.precompute(PAIRS, 8)  # nothing to cache: no reference to run
    assert obj.cache is None


@pytest.mark.slow
def test_no_second_copy_of_the_weights_without_a_reference():
    policy, model = perturbed_policy()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = live_tensor_bytes()
    simpo = PairObjective(policy, beta=2.0, loss_type="simpo")
    grown_reference_free = live_tensor_bytes() - before
    dpo = PairObjective(policy, beta=0.1, loss_type="sigmoid")  # full-model policy: a frozen copy
    grown_dpo = live_tensor_bytes() - before - grown_reference_free
    assert grown_reference_free < 0.01 * param_bytes
    assert grown_dpo >= param_bytes  # the measurement sees a copy where there is one
    del simpo, dpo


def test_simpo_losses_are_the_paper_formula_on_length_averaged_logps():
    policy, model = perturbed_policy()
    batch = policy.preference_batch(ROWS)
    losses, metrics = PairObjective(policy, beta=2.5, loss_type="simpo", loss_params={"gamma": 0.3}).losses(batch)
    c, r = (x.double() for x in policy.sequence_log_prob(batch))  # summed token log-probs
    n_c = batch.chosen["completion_mask"].sum(-1).double()
    n_r = batch.rejected["completion_mask"].sum(-1).double()
    assert_close(losses, -F.logsigmoid(2.5 * (c / n_c - r / n_r) - 0.3), dtype=torch.float32)
    assert_close(metrics["rewards/chosen"], (2.5 * c / n_c).mean(), dtype=torch.float32)
    assert "nll_loss" not in metrics


def test_orpo_losses_add_the_length_averaged_chosen_nll():
    policy, model = perturbed_policy()
    batch = policy.preference_batch(ROWS)
    losses, metrics = PairObjective(policy, beta=0.1, loss_type="orpo").losses(batch)
    c, r = (x.double() for x in policy.sequence_log_prob(batch))
    w = c / batch.chosen["completion_mask"].sum(-1)
    l_ = r / batch.rejected["completion_mask"].sum(-1)
    odds = lambda x: x - torch.log1p(-torch.exp(x))  # noqa: E731 - log(p / (1 - p)), p = e^x
    want = -w - 0.1 * F.logsigmoid(odds(w) - odds(l_))  # Hong et al. 2024, eq. 6: L_SFT + lambda L_OR
    assert_close(losses, want, dtype=torch.float32)
    assert_close(metrics["nll_loss"], (-w).mean(), dtype=torch.float32)
    # rpo_alpha overrides the entry's NLL weight (0: the odds-ratio term alone)
    alone, metrics = PairObjective(policy, beta=0.1, loss_type="orpo", rpo_alpha=0.0).losses(batch)
    assert_close(alone, want + w, dtype=torch.float32)
    assert "nll_loss" not in metrics


def test_rpo_preset_equals_sigmoid_plus_rpo_alpha_one():
    policy, _ = perturbed_policy()
    batch = policy.preference_batch(ROWS)
    a, _ = PairObjective(policy, beta=0.5, loss_type="rpo").losses(batch)
    b, _ = PairObjective(policy, beta=0.5, loss_type="sigmoid", rpo_alpha=1.0).losses(batch)
    assert_close(a, b)


def test_bad_loss_or_parameter_fails_at_construction():
    policy, _ = perturbed_policy()
    with pytest.raises(ValueError, match=r"unknown pair loss \(loss_type\) .*; choose one of"):
        PairObjective(policy, beta=0.1, loss_type="kto")
    with pytest.raises(ValueError, match="takes no parameter 'gamma'"):
        PairObjective(policy, beta=0.1, loss_type="orpo", loss_params={"gamma": 1.0})
    with pytest.raises(ValueError, match="label_smoothing applies to"):
        PairObjective(policy, beta=0.1, loss_type="simpo", label_smoothing=0.1)


@pytest.mark.parametrize("loss_type, beta, lr", [("simpo", 2.0, 5e-3), ("orpo", 1.0, 5e-3)])
def test_reference_free_losses_learn_the_preferred_answers(tmp_path, loss_type, beta, lr):
    model, tok = make_tiny_lm()
    obj = PairObjective(CausalLMPolicy(model, tok), beta=beta, loss_type=loss_type)
    cfg = PreferenceConfig(batch_size=8, micro_batch_size=4, max_steps=12, learning_rate=lr, report_to="none",
                           output_dir=str(tmp_path))
    trainer = PreferenceTrainer(obj, PAIRS, cfg)
    before = trainer.evaluate(PAIRS)
    trainer.train()
    after = trainer.evaluate(PAIRS)
    assert after["implicit_accuracy"] > 0.9 and after["loss"] < before["loss"]
    # the margin without a reference is the length-averaged log-likelihood gap
    assert averaged_implicit_accuracy(obj, PAIRS, samples=1, batch_size=5) == pytest.approx(after["implicit_accuracy"])
