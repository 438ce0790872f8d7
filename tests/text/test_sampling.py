"""How a text policy samples, as one value (``unialign.text.sampling.SamplingKnobs``): checked, translated for
transformers and vLLM, held by the policy and read by its rollout engine."""

from __future__ import annotations

import pytest
import torch

from unialign.text.sampling import SamplingKnobs


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_k=-1), dict(min_p=1.0), dict(min_p=-0.1)])
def test_an_out_of_range_knob_is_refused_naming_it(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=f"sampling: {name}="):
        SamplingKnobs(**bad)


def test_transformers_and_vllm_get_the_same_distribution():
    knobs = SamplingKnobs(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=0, min_p=0.05)
    assert knobs.hf_kwargs() == dict(do_sample=True, max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=0, min_p=0.05)
    assert knobs.vllm_kwargs() == dict(max_tokens=12, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05)
    assert "min_p" not in SamplingKnobs().hf_kwargs() and "min_p" not in SamplingKnobs().vllm_kwargs()  # off
    assert knobs.hf_kwargs(greedy=True) == dict(do_sample=False, max_new_tokens=12)
    assert knobs.vllm_kwargs(greedy=True) == dict(max_tokens=12, temperature=0.0, top_p=1.0, top_k=-1)


def test_the_policy_holds_one_value_and_its_knobs_read_and_set_it(tiny_policy):
    assert tiny_policy.sampling == SamplingKnobs(max_new_tokens=8)
    tiny_policy.temperature = 0.5
    assert tiny_policy.sampling.temperature == 0.5 and tiny_policy.temperature == 0.5
    with pytest.raises(ValueError, match="sampling: top_p="):
        tiny_policy.top_p = 2.0
    from unialign.text.policy import CausalLMPolicy

    policy = CausalLMPolicy(tiny_policy.model, tiny_policy.tokenizer, sampling=SamplingKnobs(top_k=3), temperature=0.9)
    assert policy.sampling == SamplingKnobs(top_k=3, temperature=0.9)  # the keyword sets that knob of the value


def test_every_knob_reaches_generate(tiny_policy, monkeypatch):
    """What transformers ``generate`` is called with (it implements each filter, min-p included): the policy's
    knobs when sampling, the limit alone when greedy."""
    seen = []
    real = tiny_policy.model.generate
    monkeypatch.setattr(tiny_policy.model, "generate", lambda **kw: seen.append(kw) or real(**kw))
    tiny_policy.sampling = SamplingKnobs(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=4, min_p=0.2)
    out = tiny_policy.generate(["1+1=", "2+3="])
    assert out["completion_ids"].shape[1] <= 5
    assert {k: seen[-1][k] for k in ("do_sample", "max_new_tokens", "temperature", "top_p", "top_k", "min_p")} == \
        dict(do_sample=True, max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=4, min_p=0.2)
    tiny_policy.generate(["1+1="], greedy=True, max_new_tokens=3)
    assert seen[-1]["do_sample"] is False and seen[-1]["max_new_tokens"] == 3 and "min_p" not in seen[-1]


# ------------------------------------------------------------------ stop strings
def test_a_stop_flag_reads_one_string_with_escapes_or_a_json_list():
    from unialign.text.sampling import parse_stop

    assert parse_stop(None) == parse_stop("") == ()
    assert parse_stop(r"\n\nQuestion:") == ("\n\nQuestion:",) and parse_stop(r"a\\nb") == ("a\\nb",)
    assert parse_stop('["\\n\\n", "Question:"]') == ("\n\n", "Question:")
    assert parse_stop('{"a": 1}') == ('{"a": 1}',)  # only a value opening with [ is read as a list
    for bad in ("[1]", "[", '[""]'):
        with pytest.raises(ValueError):
            parse_stop(bad)
    assert SamplingKnobs(stop=["x"]).stop == ("x",)  # held as a tuple
    for bad in ("x", [""], [3]):
        with pytest.raises(ValueError, match="sampling: stop="):
            SamplingKnobs(stop=bad)


def test_stop_lengths_keep_the_token_that_completes_the_first_stop_string():
    from unialign.text.sampling import stop_lengths

    vocab = ["ab", "c\n", "\nQ", "d", "##", "e"]

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    rows = [[0, 1, 2, 3], [0, 3, 5], [4, 0, 4, 4], [1, 2]]
    # row 0: "ab" "c\n" "\nQ": "\n\n" completes on token 2 -> 3 kept; row 1: none; row 2: "##" at token 0 -> 1;
    # row 3: the earliest of two stop strings counts ("\n\n" ends at token 1, "Q" too) -> 2
    assert stop_lengths(rows, decode, ("\n\n", "##")) == [3, None, 1, 2]
    assert stop_lengths(rows, decode, ()) == [None] * 4
    for row, k in zip(rows, stop_lengths(rows, decode, ("\n\n", "##"))):  # the shortest prefix, by brute force
        if k is not None:
            assert any(s in decode(row[:k]) for s in ("\n\n", "##"))
            assert not any(s in decode(row[:k - 1]) for s in ("\n\n", "##"))


def test_finish_completions_ends_rows_at_a_stop_string_as_at_eos(tiny_policy):
    import torch

    from unialign.text.rollout import finish_completions

    tok = tiny_policy.tokenizer
    ids = [tok.convert_tokens_to_ids(c) for c in "12=34"]
    pad, eos = tok.pad_token_id, tok.eos_token_id
    completion = torch.tensor([ids + [pad], ids[:2] + [eos, pad, pad, pad], [ids[0]] * 6])
    mask = torch.tensor([[1] * 5 + [0], [1, 1, 1, 0, 0, 0], [1] * 6])
    truncated = torch.tensor([True, False, True])
    out = finish_completions(completion, mask, truncated, tok, ("=3",))
    assert out["texts"] == ["12", "12", "111111"]
    assert out["completion_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1] * 6]
    assert out["completion_ids"][0].tolist() == ids[:4] + [pad, pad]  # "=3" is kept in the tokens, 4 after it goes
    assert out["truncated"].tolist() == [False, False, True]  # ended by the stop string, by EOS, by the limit
    assert completion[0].tolist() == ids + [pad]  # the input is not changed
    plain = finish_completions(completion, mask, truncated, tok, ())
    assert plain["texts"] == ["12=34", "12", "111111"] and torch.equal(plain["completion_mask"], mask)


def test_a_policy_with_stop_strings_samples_the_prefix_it_samples_without(tiny_policy, monkeypatch):
    """Greedy decoding with a stop string gives the unstopped completion up to it: transformers is told
    (``stop_strings`` with the tokenizer), the kept tokens end on the one completing it, the text before it."""
    tiny_policy.sampling = SamplingKnobs(max_new_tokens=8)
    free = tiny_policy.generate(["1+1=", "2+3="], greedy=True)
    text = free["texts"][0]
    assert len(text) >= 4, "the tiny model's greedy completion is too short for this test"
    stop = text[2:4]
    seen = []
    real = tiny_policy.model.generate
    monkeypatch.setattr(tiny_policy.model, "generate", lambda **kw: seen.append(kw) or real(**kw))
    tiny_policy.sampling = SamplingKnobs(max_new_tokens=8, stop=(stop,))
    cut = tiny_policy.generate(["1+1=", "2+3="], greedy=True)
    assert seen[-1]["stop_strings"] == [stop] and seen[-1]["tokenizer"] is tiny_policy.tokenizer
    assert cut["texts"][0] == text[:text.find(stop)] and not cut["truncated"][0]
    k = int(cut["completion_mask"][0].sum())
    assert cut["completion_ids"][0, :k].tolist() == free["completion_ids"][0, :k].tolist()
    assert stop in tiny_policy.tokenizer.decode(cut["completion_ids"][0, :k])
    assert stop not in tiny_policy.tokenizer.decode(cut["completion_ids"][0, :k - 1])


def test_a_stop_flag_that_does_not_read_is_refused_naming_it_before_anything_loads():
    from dataclasses import dataclass

    from unialign.config import parse_config
    from unialign.errors import UserError
    from unialign.recipes.args import TextSamplingArgs

    @dataclass
    class C(TextSamplingArgs):
        pass

    assert parse_config(C, ["--stop", r"\n\n"]).sampling().stop == ("\n\n",)
    assert parse_config(C, []).sampling().stop == ()
    with pytest.raises(UserError, match="--stop: '\\[1' is not a JSON list"):
        parse_config(C, ["--stop", "[1"])


def first_token_probs(policy, prompt: str, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution of the first sampled token, computed here: softmax(logits / T) over the top-k, renormalised."""
    enc = policy._encode_prompts([prompt])
    with torch.no_grad():
        logits = policy.model(**enc).logits[0, -1].double() / temperature
    keep = torch.topk(logits, top_k).indices
    probs = torch.zeros_like(logits)
    probs[keep] = torch.softmax(logits[keep], -1)
    return probs


def test_seeded_sampling_draws_the_warped_distribution_from_its_generator_alone(tiny_policy):
    """``sample(generator=...)`` (async rollouts): the distribution of the knobs (Gumbel-max after temperature and
    top-k), the same draws for the same seed, other draws for another, and torch's global RNG untouched."""
    tiny_policy.sampling = SamplingKnobs(max_new_tokens=1, temperature=0.05, top_k=5)  # 0.10-0.35 each (tiny logits)
    prompts = ["3+4?"] * 3000
    before = torch.random.get_rng_state()
    first = tiny_policy.sample(prompts, generator=torch.Generator().manual_seed(5), record_logp=False)
    assert torch.equal(torch.random.get_rng_state(), before)
    ids = first.payload["completion_ids"][:, 0]
    expected = first_token_probs(tiny_policy, "3+4?", 0.05, 5)
    seen = torch.bincount(ids, minlength=expected.numel()).double() / len(ids)
    assert (seen[expected == 0] == 0).all()  # nothing outside the top 5
    assert 0.5 * (seen - expected).abs().sum() < 0.03, (seen[expected > 0], expected[expected > 0])
    again = tiny_policy.sample(prompts[:64], generator=torch.Generator().manual_seed(5), record_logp=False)
    assert torch.equal(again.payload["completion_ids"], first.payload["completion_ids"][:64])
    other = tiny_policy.sample(prompts[:64], generator=torch.Generator().manual_seed(6), record_logp=False)
    assert not torch.equal(other.payload["completion_ids"], again.payload["completion_ids"])


def test_seeded_sampling_in_a_thread_ignores_the_global_rng_drawn_beside_it(tiny_policy):
    import threading

    prompts = ["1+2?", "5+5?"] * 8
    alone = tiny_policy.sample(prompts, generator=torch.Generator().manual_seed(1), record_logp=False)
    out, done = {}, threading.Event()

    def sample():
        out["traj"] = tiny_policy.sample(prompts, generator=torch.Generator().manual_seed(1), record_logp=False)
        done.set()

    thread = threading.Thread(target=sample)
    thread.start()
    while not done.is_set():  # the trainer's draws meanwhile
        torch.rand(1000)
    thread.join()
    assert torch.equal(out["traj"].payload["completion_ids"], alone.payload["completion_ids"])


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_a_sampling_view_keeps_decoding_s_log_probs_instead_of_a_scoring_forward(tiny_policy, knobs):
    """An async rollout view sampling from its generator records the log-probs decoding computed
    (``DecodeLogProbs``): the trainer's scoring forward's quantity (log-softmax at the temperature, before top-k /
    top-p), with no forward over the completions; the trained policy, and a view drawing from the global RNG
    (staleness 0: the synchronous run), keep the forward."""
    tiny_policy.sampling = SamplingKnobs(max_new_tokens=12, **knobs)
    view = tiny_policy.sampling_view(tiny_policy.model)
    prompts = ["1+2?", "what is 33+4? be quick"] * 4
    calls: list[int] = []
    hook = tiny_policy.model.register_forward_hook(lambda m, a, k, out: calls.append(k["input_ids"].shape[1]),
                                                   with_kwargs=True)
    try:
        traj = view.sample(prompts, generator=torch.Generator().manual_seed(3), record_logp=True)
        decoded_calls = list(calls)
        calls.clear()
        forward = tiny_policy.log_prob(traj) * traj.mask_B_T
    finally:
        hook.remove()
    T = traj.payload["completion_ids"].shape[1]
    assert traj.mask_B_T.sum() > len(prompts) and (traj.old_logp_B_T != 0).any()
    torch.testing.assert_close(traj.old_logp_B_T, forward, rtol=0, atol=1e-5)
    assert T + 1 not in decoded_calls and all(c <= 1 for c in decoded_calls[2:])  # prefill, then one token each
    again = tiny_policy.sample(prompts, generator=torch.Generator().manual_seed(3), record_logp=True)
    assert torch.equal(again.payload["completion_ids"], traj.payload["completion_ids"])  # the same draws
    torch.testing.assert_close(again.old_logp_B_T, traj.old_logp_B_T, rtol=0, atol=1e-5)  # the policy's: a forward
    penalised = tiny_policy.sampling_view(tiny_policy.model)
    penalised.sampling = penalised.sampling.with_(repetition_penalty=1.3)  # scores the trainer does not compute
    traj = penalised.sample(prompts, generator=torch.Generator().manual_seed(3), record_logp=True)
    assert torch.equal(traj.old_logp_B_T, tiny_policy.log_prob(traj) * traj.mask_B_T)  # the same forward


def test_decoding_log_probs_are_gathered_at_each_step_s_chosen_token():
    from unialign.text.sampling import DecodeLogProbs

    torch.manual_seed(0)
    scores = [torch.randn(3, 7) for _ in range(4)]
    chosen = torch.randint(0, 7, (3, 4))
    rec = DecodeLogProbs(temperature=0.5)
    for t, s in enumerate(scores):  # input_ids at step t ends with the tokens chosen before it
        assert rec(torch.cat([torch.zeros(3, 2, dtype=torch.long), chosen[:, :t]], 1), s) is s
    got = rec.logp(torch.cat([torch.zeros(3, 2, dtype=torch.long), chosen], 1))
    want = torch.stack([torch.log_softmax(s / 0.5, -1).gather(-1, chosen[:, t:t + 1])[:, 0]
                        for t, s in enumerate(scores)], 1)
    assert torch.equal(got, want)
    assert DecodeLogProbs(1.0).logp(torch.zeros(3, 2, dtype=torch.long)).shape == (3, 0)
