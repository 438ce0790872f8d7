"""The pairwise loop: DPO through the one algos.dpo_loss, ln 2 at init, learning, reward models, bad rows."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_tiny_lm
from tests.helpers import assert_close
from unialign import algos
from unialign.text.policy import CausalLMPolicy
from unialign.text.preference import normalize_pairs
from unialign.trainers.preference import (
    BradleyTerryObjective,
    DPOObjective,
    PreferenceConfig,
    PreferenceTrainer,
    averaged_implicit_accuracy,
)

PAIRS = [{"prompt": f"{a}+{a}?", "chosen": f"{2 * a}", "rejected": f"{2 * a + 1}"} for a in range(10, 26)]


def config(tmp_path, **kw):
    base = dict(batch_size=8, micro_batch_size=4, max_steps=3, learning_rate=5e-3, report_to="none",
                output_dir=str(tmp_path))
    base.update(kw)
    return PreferenceConfig(**base)


def test_first_dpo_loss_is_ln2_and_goes_through_algos_dpo_loss(tmp_path, monkeypatch):
    calls = []
    real = algos.dpo_loss
    monkeypatch.setattr(algos, "dpo_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, tok = make_tiny_lm()
    obj = DPOObjective(CausalLMPolicy(model, tok), beta=0.1)
    trainer = PreferenceTrainer(obj, PAIRS, config(tmp_path))
    history = trainer.train()
    assert calls and abs(history[0]["loss"] - math.log(2)) < 1e-6
    assert history[0]["implicit_accuracy"] == 0.5  # every pair tied at init: ties count 1/2


def test_dpo_loss_matches_hand_computed_sequence_logps():
    model, tok = make_tiny_lm()
    policy = CausalLMPolicy(model, tok)
    obj = DPOObjective(policy, beta=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = policy.preference_batch(PAIRS[:4])
    losses, _ = obj.losses(batch)
    c, r = policy.sequence_log_prob(batch)
    rc, rr = policy.reference().sequence_log_prob(batch)
    h = (c - r) - (rc - rr)
    assert_close(losses, -torch.nn.functional.logsigmoid(0.5 * h))
    # the summed log-likelihood is the sum of the completion's token log-probs
    side = batch.chosen
    logits = model(input_ids=torch.cat([side["prompt_ids"], side["completion_ids"]], 1),
                   attention_mask=torch.cat([side["prompt_mask"], side["completion_mask"]], 1)).logits
    T = side["completion_ids"].shape[1]
    tok_logp = torch.log_softmax(logits[:, -T - 1:-1].float(), -1).gather(-1, side["completion_ids"][..., None])[..., 0]
    assert_close(c, (tok_logp * side["completion_mask"]).sum(-1))


def test_dpo_learns_the_preferred_answers_and_cached_reference_agrees(tmp_path):
    model, tok = make_tiny_lm()
    obj = DPOObjective(CausalLMPolicy(model, tok), beta=0.5, cache_reference=True)
    obj.precompute(PAIRS, 8, tmp_path / "ref.safetensors")
    cached = dict(obj.cache)
    trainer = PreferenceTrainer(obj, PAIRS, config(tmp_path, max_steps=12))
    before = trainer.evaluate(PAIRS)
    trainer.train()
    after = trainer.evaluate(PAIRS)
    assert after["implicit_accuracy"] > 0.9 and after["loss"] < before["loss"]
    # text log-probs are deterministic: averaging the margin over draws changes nothing (batch size either way)
    assert averaged_implicit_accuracy(obj, PAIRS, samples=3, batch_size=3) == pytest.approx(after["implicit_accuracy"])
    assert obj.cache == cached  # the reference never moved
    fresh = DPOObjective(CausalLMPolicy(*make_tiny_lm()), beta=0.5, cache_reference=True)
    fresh.precompute(PAIRS, 8, tmp_path / "ref.safetensors")  # loaded from disk
    assert fresh.cache == cached


@pytest.mark.parametrize("damage", ["truncate", "garbage", "fewer_rows"])
def test_a_damaged_reference_cache_is_rebuilt_not_trusted(tmp_path, capsys, damage):
    path = tmp_path / "ref.safetensors"
    obj = DPOObjective(CausalLMPolicy(*make_tiny_lm()), beta=0.5, cache_reference=True)
    obj.precompute(PAIRS, 8, path)
    good = dict(obj.cache)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-7])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    else:
        DPOObjective(CausalLMPolicy(*make_tiny_lm()), beta=0.5, cache_reference=True).precompute(PAIRS[:2], 8, path)
    fresh = DPOObjective(CausalLMPolicy(*make_tiny_lm()), beta=0.5, cache_reference=True)
    fresh.precompute(PAIRS, 8, path)
    assert "damaged reference cache" in capsys.readouterr().err
    assert fresh.cache == good
    again = DPOObjective(CausalLMPolicy(*make_tiny_lm()), beta=0.5, cache_reference=True)
    again.precompute(PAIRS, 8, path)  # rewritten whole: read back silently
    assert again.cache == good and "damaged" not in capsys.readouterr().err


def test_reward_model_learns_pairs(tmp_path):
    from transformers import LlamaForSequenceClassification

    from unialign.text.reward_model import RewardModel

    lm, tok = make_tiny_lm()
    cfg = lm.config
    cfg.num_labels = 1
    rm = RewardModel(LlamaForSequenceClassification(cfg), tok)
    trainer = PreferenceTrainer(BradleyTerryObjective(rm, center_coef=0.01), PAIRS, config(tmp_path, max_steps=15))
    trainer.train()
    assert trainer.evaluate(PAIRS)["accuracy"] >= 0.9
    scores = rm.score([p["prompt"] for p in PAIRS], [p["chosen"] for p in PAIRS])
    assert scores.shape == (len(PAIRS),) and torch.isfinite(scores).all()


def test_normalize_pairs_formats_and_errors():
    conv = [{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]}]
    assert normalize_pairs(conv)[0]["prompt"] == [{"role": "user", "content": "hi"}]
    implicit = [{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                 "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}]
    out = normalize_pairs(implicit)[0]
    assert out["prompt"] == [{"role": "user", "content": "q"}] and out["chosen"][0]["content"] == "a"
    with pytest.raises(ValueError, match="row 1: missing field 'rejected'"):
        normalize_pairs([PAIRS[0], {"prompt": "x", "chosen": "y"}])
    with pytest.raises(ValueError, match="row 0: field 'chosen' must be"):
        normalize_pairs([{"prompt": "x", "chosen": "", "rejected": "y"}])
    with pytest.raises(ValueError, match="row 0: field 'margin' must be a number"):
        normalize_pairs([{"prompt": "x", "chosen": "a", "rejected": "y", "margin": "big"}])


def _unbatched_logp(model, tok, prompt_ids: list[int], completion: str) -> torch.Tensor:
    """Sum of log p(completion token) for ONE unpadded sequence, straight from the logits."""
    comp = tok(completion + tok.eos_token, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + comp])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(comp)[:, None]).sum()


def test_chosen_and_rejected_of_unequal_lengths_share_one_forward_and_match_unpadded_logps():
    model, tok = make_tiny_lm()
    policy = CausalLMPolicy(model, tok)
    rows = [{"prompt": "1+1?", "chosen": "2", "rejected": "two, surely"},
            {"prompt": "what is 10+10?", "chosen": "twenty exactly", "rejected": "21"}]
    batch = policy.preference_batch(rows)
    calls = []
    hook = model.register_forward_hook(lambda m, a, k, out: calls.append(k["input_ids"].shape[0]), with_kwargs=True)
    with torch.no_grad():
        c, r = policy.sequence_log_prob(batch)
        c_mean, _ = policy.sequence_log_prob(batch, length_normalize=True)
    hook.remove()
    assert calls == [2, 4, 2, 4]  # per call: the 2 distinct prompts once, then one 2B pass
    for i, row in enumerate(rows):
        enc = policy._encode_prompts([row["prompt"]])
        prompt_ids = enc["input_ids"][0][enc["attention_mask"][0].bool()].tolist()
        with torch.no_grad():
            want_c = _unbatched_logp(model, tok, prompt_ids, row["chosen"])
            want_r = _unbatched_logp(model, tok, prompt_ids, row["rejected"])
        assert_close(c[i], want_c)
        assert_close(r[i], want_r)
        n_tokens = len(tok(row["chosen"] + tok.eos_token, add_special_tokens=False)["input_ids"])
        assert_close(c_mean[i], want_c / n_tokens)
        assert float(batch.chosen_length_B[i]) == n_tokens


def test_rpo_adds_the_per_token_nll_of_the_chosen_side():
    model, tok = make_tiny_lm()
    policy = CausalLMPolicy(model, tok)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    rows = [{"prompt": "3+4?", "chosen": "7", "rejected": "eight"}, {"prompt": "5+5?", "chosen": "ten", "rejected": "9"}]
    batch = policy.preference_batch(rows)
    plain, _ = DPOObjective(policy, beta=0.5).losses(batch)
    rpo, metrics = DPOObjective(policy, beta=0.5, rpo_alpha=0.7).losses(batch)
    c, _ = policy.sequence_log_prob(batch)
    lengths = torch.tensor([len(tok(r["chosen"] + tok.eos_token, add_special_tokens=False)["input_ids"]) for r in rows])
    nll = -c / lengths  # Pang et al. 2024 eq. 3: -log pi(y_w|x) / |y_w|
    assert_close(rpo, plain + 0.7 * nll)
    assert_close(metrics["nll_loss"], nll.mean())


def test_a_reward_model_that_trained_nothing_is_an_error_not_a_success(tmp_path, capsys):
    """NaN margins skip every step: the run is refused at the end (one line, exit 2), final/ is not written and
    summary.json says trained: false with the skipped steps (it was silent, and the script exited 0)."""
    import json

    from transformers import LlamaForSequenceClassification

    from unialign.config import exit_on_user_error
    from unialign.text.reward_model import RewardModel
    from unialign.trainers import finish_run

    lm, tok = make_tiny_lm()
    lm.config.num_labels = 1
    rm = RewardModel(LlamaForSequenceClassification(lm.config), tok)
    objective = BradleyTerryObjective(rm)
    losses = objective.losses
    objective.losses = lambda batch, ids=None: (lambda out: (out[0] * math.nan, out[1]))(losses(batch, ids))
    trainer = PreferenceTrainer(objective, PAIRS, config(tmp_path, max_steps=3))
    trainer.train()
    with pytest.raises(SystemExit) as exit_info, exit_on_user_error():
        finish_run(trainer.acc, trainer.cfg, {"steps": trainer.step}, rm.save)  # the script passes no counters
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: nothing was trained: all 3 steps were skipped (non-finite loss or gradient norm")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trained"] is False and summary["skipped_steps"] == 3
    assert not (tmp_path / "final").exists()
