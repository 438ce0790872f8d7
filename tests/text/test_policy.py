"""CausalLMPolicy: recorded log-probs, fused head vs naive logits, reference, LoRA, masks."""

from __future__ import annotations

import torch

from tests.conftest import make_tiny_lm
from tests.helpers import assert_close
from unialign.text.policy import CausalLMPolicy
from unialign.types import Trajectory


def naive_logp(model, payload):
    """log_softmax over materialised logits, gathered at the completion tokens (the textbook way)."""
    ids = torch.cat([payload["prompt_ids"], payload["completion_ids"]], 1)
    am = torch.cat([payload["prompt_mask"], payload["completion_mask"]], 1)
    head = model.get_output_embeddings()
    hidden = model.model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
    logits = hidden @ head.weight.T
    T = payload["completion_ids"].shape[1]
    return torch.log_softmax(logits[:, -T - 1:-1].float(), -1).gather(-1, payload["completion_ids"].unsqueeze(-1))[..., 0]


def test_sample_records_logp_equal_to_recomputed_and_naive(tiny_policy):
    torch.manual_seed(0)
    traj = tiny_policy.sample(["1+2?", "what is 33+4? be quick", "1+2?"])
    assert traj.mask_B_T.shape == traj.old_logp_B_T.shape == traj.payload["completion_ids"].shape
    assert len(traj.completions) == 3 and traj.truncated_B.dtype == torch.bool
    recomputed = tiny_policy.log_prob(traj)
    assert_close(recomputed, traj.old_logp_B_T)  # ratio 1 on the first on-policy recomputation
    assert_close(recomputed, naive_logp(tiny_policy.model, traj.payload) * traj.mask_B_T)


def test_gradients_match_naive(tiny_policy):
    torch.manual_seed(1)
    traj = tiny_policy.sample(["12+30?", "7-2?"])
    w = torch.randn_like(traj.mask_B_T)
    model = tiny_policy.model
    (tiny_policy.log_prob(traj) * w).sum().backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (naive_logp(model, traj.payload) * traj.mask_B_T * w).sum().backward()
    for n, p in model.named_parameters():
        assert_close(fused[n], p.grad, msg=n)


def test_mask_stops_after_first_eos(tiny_policy):
    torch.manual_seed(2)
    traj = tiny_policy.sample(["hi"] * 8)
    eos = tiny_policy.tokenizer.eos_token_id
    for ids, m, trunc in zip(traj.payload["completion_ids"], traj.mask_B_T, traj.truncated_B):
        n = int(m.sum())
        assert bool(trunc) == (eos not in ids[:n].tolist())
        if not trunc:
            assert ids[n - 1] == eos and (m[:n] == 1).all() and (m[n:] == 0).all()


def test_cat_of_different_widths_keeps_logp(tiny_policy):
    torch.manual_seed(3)
    a = tiny_policy.sample(["1+1?"] * 2)
    b = tiny_policy.sample(["a much longer prompt: 11+22?"] * 2)
    both = Trajectory.cat([a, b])
    lp = tiny_policy.log_prob(both)
    assert_close(lp[:2, : a.mask_B_T.shape[1]], a.old_logp_B_T)
    assert_close(lp[2:, : b.mask_B_T.shape[1]], b.old_logp_B_T)


def test_reference_is_frozen_copy_without_lora():
    model, tok = make_tiny_lm()
    policy = CausalLMPolicy(model, tok, max_new_tokens=6)
    traj = policy.sample(["5+5?"] * 2)
    ref = policy.reference()
    before = ref.log_prob(traj)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    assert_close(ref.log_prob(traj), before)
    assert not torch.allclose(policy.log_prob(traj), before)


def test_lora_reference_disables_adapters():
    from peft import LoraConfig, get_peft_model

    base, tok = make_tiny_lm()
    pristine = CausalLMPolicy(make_tiny_lm()[0], tok, max_new_tokens=6)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    policy = CausalLMPolicy(model, tok, max_new_tokens=6)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    traj = policy.sample(["5+5?"] * 2)
    assert_close(policy.reference().log_prob(traj), pristine.log_prob(traj))
    assert not torch.allclose(policy.log_prob(traj), pristine.log_prob(traj))
    assert all("lora" in n for n, p in model.named_parameters() if p.requires_grad)


def test_from_pretrained_offline_fails_fast_and_clearly(tmp_path):
    import time

    import pytest

    from unialign.hub import HubUnavailableError

    t0 = time.time()
    with pytest.raises(HubUnavailableError, match="not in the local cache"):
        CausalLMPolicy.from_pretrained("someone/not-a-real-model-xyz")
    assert time.time() - t0 < 10


def test_save_roundtrip_with_stock_transformers(tiny_policy, tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_policy.save(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    for (n, p), (_, q) in zip(tiny_policy.model.named_parameters(), loaded.named_parameters()):
        assert_close(q, p, msg=n)
