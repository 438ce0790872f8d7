"""Rollout/trainer mismatch: a bfloat16 rollout copy records its own log-probs, the trainer's
ratio-1 check still compares against the trainer's, and the loss is re-weighted by rollout_correction."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.conftest import make_tiny_lm
from unialign import algos
from unialign.text.policy import CausalLMPolicy
from unialign.trainers import OnlineConfig, OnlineTrainer

ROWS = [{"prompt": f"{i}+{i}?", "answer": str(2 * i)} for i in range(12)]


def length_reward(prompts, completions):
    return [len(c) / 8.0 for c in completions]


def plain_logp(model, payload, dtype):
    """Independent per-token log-probs: the untouched HF model in ``dtype``, full logits, log_softmax."""
    m = copy.deepcopy(model).to(dtype).eval()
    prompt, pmask = payload["prompt_ids"], payload["prompt_mask"]
    comp, cmask = payload["completion_ids"], payload["completion_mask"]
    ids, att = torch.cat([prompt, comp], 1), torch.cat([pmask, cmask], 1)
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0)).logits.float()
    W, T = prompt.shape[1], comp.shape[1]
    logp = torch.log_softmax(logits[:, W - 1:W - 1 + T], -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    return logp * cmask


def test_bf16_rollout_copy_samples_and_records_its_own_logprobs():
    model, tok = make_tiny_lm(seed=1)
    original = copy.deepcopy(model)
    policy = CausalLMPolicy(model, tok, max_new_tokens=8, rollout_dtype="bfloat16")
    torch.manual_seed(0)
    traj = policy.sample(["1+2?"] * 4 + ["what is 33+4?"] * 4)
    mask = traj.mask_B_T
    assert traj.rollout_logp_B_T is not None and traj.rollout_logp_B_T.dtype == torch.float32
    assert torch.equal(traj.rollout_logp_B_T * (1 - mask), torch.zeros_like(mask))
    old32, roll16 = plain_logp(original, traj.payload, torch.float32), plain_logp(original, traj.payload, torch.bfloat16)
    # old log-probs are the trainer's float32 ones; rollout ones are the bfloat16 model's
    assert torch.allclose(traj.old_logp_B_T, old32, atol=1e-4)
    assert torch.allclose(traj.rollout_logp_B_T, roll16, atol=3e-2)
    gap = ((traj.rollout_logp_B_T - traj.old_logp_B_T).abs() * mask).max()
    assert gap > 1e-3  # a real mismatch
    # the trained model is untouched (float32) and greedy evaluation runs on it
    assert next(policy.model.parameters()).dtype == torch.float32
    # weights are pushed into the copy before each sampling call
    with torch.no_grad():
        next(policy.model.parameters()).add_(1.0)
    copy16 = policy.rollout_model()
    assert torch.equal(next(copy16.parameters()), next(policy.model.parameters()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="rollout_dtype"):
        CausalLMPolicy(model, tok, rollout_dtype="int8")


def make_trainer(tmp_path, **kw):
    model, tok = make_tiny_lm(seed=0)
    policy = CausalLMPolicy(model, tok, max_new_tokens=8, rollout_dtype="bfloat16")
    cfg = dict(num_generations=4, prompts_per_step=2, micro_batch_size=8, max_steps=2, report_to="none",
               output_dir=str(tmp_path), learning_rate=1e-2, beta=0.0, seed=0, loss_type="dapo")
    cfg.update(kw)
    return OnlineTrainer(policy, length_reward, ROWS, OnlineConfig(**cfg))


@pytest.mark.parametrize("mode, level, cap", [("truncate", "token", 1.0), ("mask", "token", 1.002),
                                              ("truncate", "sequence", 1.5), ("off", "token", 2.0)])
def test_loss_is_the_policy_loss_times_the_independent_weights(tmp_path, mode, level, cap):
    trainer = make_trainer(tmp_path, rollout_correction=mode, rollout_correction_level=level,
                           rollout_correction_cap=cap)
    torch.manual_seed(0)
    traj = trainer.policy.sample(["1+2?"] * 4 + ["what is 33+4?"] * 4)
    traj.rollout_logp_B_T = traj.rollout_logp_B_T + 0.3 * traj.mask_B_T * (2 * torch.rand_like(traj.mask_B_T) - 1)
    adv = torch.linspace(-1.0, 1.5, 8)
    traj.advantages_B_T = adv.unsqueeze(-1).expand_as(traj.mask_B_T).contiguous()
    mask = traj.mask_B_T
    n = mask.sum()
    loss, m = trainer._loss(traj, n, n)  # ratio-1 check runs here, against the trainer's old log-probs
    assert trainer.ratio_checked
    # independent weights from the definition (ratio 1 at the first step: the policy loss is -A per token)
    old, roll = traj.old_logp_B_T.double(), traj.rollout_logp_B_T.double()
    if level == "token":
        r = torch.exp(old - roll)
    else:
        r = torch.exp(((old - roll) * mask).sum(-1, keepdim=True)).expand_as(old)
    w = {"truncate": r.clamp(max=cap), "mask": torch.where(r > cap, 0.0, r), "off": torch.ones_like(r)}[mode]
    expected = (-traj.advantages_B_T.double() * w * mask).sum() / n
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert m["rollout/mismatch_max"].item() == pytest.approx(float(((old - roll).abs() * mask).max()), rel=1e-5)
    if mode != "off":
        assert 0 < m["rollout/clipped_frac"].item() < 1


def test_training_with_a_bf16_rollout_logs_the_mismatch_and_passes_the_ratio_check(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    history = trainer.train()
    steps = [h for h in history if "rollout/mismatch_mean" in h]
    assert len(steps) == 2
    assert all(h["rollout/mismatch_mean"] > 0 and math.isfinite(h["rollout/weight_mean"]) for h in steps)
    assert trainer.counters["skipped_steps"] == 0


def test_the_correction_function_is_what_the_trainer_uses():
    """Guards the wiring: the trainer calls algos.rollout_correction (not a copy of it)."""
    import unialign.trainers.online as online

    assert online.algos.rollout_correction is algos.rollout_correction
