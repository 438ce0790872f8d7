"""How a text policy samples, as one value (``unialign.text.sampling.SamplingKnobs``): checked, translated for
transformers and vLLM, held by the policy and read by its rollout engine."""

from __future__ import annotations

import pytest

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
