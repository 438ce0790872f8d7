"""The colocated vLLM engine without vLLM: a stand-in ``LLM`` with the shapes of vLLM's ``RequestOutput`` /
``CompletionOutput`` / ``Logprob`` checks the prompt deduplication, the sampling-parameter mapping, the
output packing and the weight push (names, merged LoRA values, model left untouched)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import pytest
import torch

from tests.conftest import make_tiny_lm
from unialign.text import vllm_engine as ve
from unialign.text.sampling import SamplingKnobs


# ------------------------------------------------------------------ stand-ins for vLLM's objects
@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = 1
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    text: str = ""
    cumulative_logprob: float | None = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def completion(index, ids, logps):
    return CompletionOutput(index, list(ids), [{t: Logprob(lp)} for t, lp in zip(ids, logps)])


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


class ServedModel:
    """The engine-side model: records what each ``load_weights`` call received."""

    def __init__(self):
        self.loads: list[dict[str, torch.Tensor]] = []

    def load_weights(self, weights):
        got = {name: t.detach().clone() for name, t in weights}
        self.loads.append(got)
        return set(got)


@dataclass
class FakeLLM:
    """``vllm.LLM``'s methods the engine uses. ``script(prompt_ids, k) -> (token_ids, logps)`` for the k-th
    completion of a request; a seeded request's k-th completion gets ``k = seed + k`` instead (vLLM's child
    seeds), so what it returns follows the seed. ``sampling_params``: one, or a list of one per prompt."""

    script: object = None
    init_kwargs: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)
    served: ServedModel = field(default_factory=ServedModel)

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.calls.append(("generate", prompts, sampling_params))
        per_prompt = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        assert len(per_prompt) == len(prompts)
        return [RequestOutput(str(i), p["prompt_token_ids"],
                              [completion(k, *self.script(p["prompt_token_ids"], (getattr(sp, "seed", None) or 0) + k))
                               for k in range(sp.n)])
                for i, (p, sp) in enumerate(zip(prompts, per_prompt))]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def apply_model(self, func):
        self.calls.append(("apply_model",))
        return [func(self.served)]


def build_engine(model, tok, script=None, **kwargs):
    box = {}

    def factory(**llm_kwargs):
        box["llm"] = FakeLLM(script=script, init_kwargs=llm_kwargs)
        return box["llm"]

    engine = ve.VLLMEngine(model, tok, llm_factory=factory, sampling_params_cls=SamplingParams, **kwargs)
    return engine, box["llm"]


def lora_lm(seed=0):
    from peft import LoraConfig, get_peft_model

    model, tok = make_tiny_lm(seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # LoRA's B starts at zero: make the adapters matter
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return peft_model, tok


def merged_state_dict(peft_model):
    """peft's own merge of a copy: the independent reference for the pushed values."""
    return {k: v for k, v in copy.deepcopy(peft_model).merge_and_unload().state_dict().items()}


# ------------------------------------------------------------------ availability
def test_check_vllm_available_names_the_missing_piece(monkeypatch):
    if not torch.cuda.is_available():  # this CPU machine: the CUDA line
        with pytest.raises(RuntimeError) as err:
            ve.check_vllm_available()
        assert str(err.value) == ("--generation_backend vllm needs a CUDA GPU; this machine has none: "
                                  "use --generation_backend hf")
        model, tok = make_tiny_lm()
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):  # before anything is built
            ve.VLLMEngine(model, tok)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError) as err:
        ve.check_vllm_available()
    assert "\n" not in str(err.value)
    assert "pip install 'unialign[vllm]'" in str(err.value) and "README" in str(err.value)


# ------------------------------------------------------------------ sampling parameters
def test_sampling_kwargs_match_hf_semantics():
    knobs = SamplingKnobs(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=0)
    kw = ve.sampling_kwargs(4, knobs, greedy=False, eos_token_id=2)
    assert kw["n"] == 4 and kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["max_tokens"] == 16
    assert kw["top_k"] == -1  # HF's 0 = off is vLLM's -1
    assert "min_p" not in kw  # off: not passed
    assert kw["logprobs"] == 0  # the sampled token's log-prob only
    assert kw["stop_token_ids"] == [2] and kw["ignore_eos"] is True  # stop on the policy's EOS, and only on it
    assert ve.sampling_kwargs(4, knobs.with_(temperature=1.0, top_p=1.0, top_k=5), greedy=False,
                              eos_token_id=2)["top_k"] == 5
    assert ve.sampling_kwargs(4, knobs.with_(min_p=0.05), greedy=False, eos_token_id=2)["min_p"] == 0.05
    greedy = ve.sampling_kwargs(4, knobs.with_(top_k=5, min_p=0.05), greedy=True, eos_token_id=2)
    assert (greedy["n"], greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (1, 0.0, 1.0, -1)
    assert "min_p" not in greedy


def test_llm_kwargs_colocate_processed_logprobs():
    kw = ve.llm_kwargs("/m", gpu_memory_utilization=0.3, max_model_len=512, dtype="auto", seed=3,
                       enable_sleep_mode=True)
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["trust_remote_code"] is False
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["enable_sleep_mode"] is True
    assert (kw["model"], kw["gpu_memory_utilization"], kw["max_model_len"], kw["seed"]) == ("/m", 0.3, 512, 3)


# ------------------------------------------------------------------ packing
def test_pack_outputs_cuts_at_eos_pads_and_flags_truncation():
    eos, pad = 2, 0
    outputs = [
        RequestOutput("0", [9], [completion(0, [5, 2], [-0.5, -0.1]),              # stops on EOS
                                 completion(1, [6, 7, 8, 9], [-1., -2., -3., -4.])]),  # ran out of tokens
        RequestOutput("1", [8], [completion(0, [2], [-0.2]),                       # EOS at once
                                 completion(1, [7, 2, 9], [-0.3, -0.4, -0.9])]),   # tokens after EOS dropped
    ]
    got = ve._pack_outputs(outputs, n=2, eos_token_id=eos, pad_token_id=pad, max_new_tokens=4)
    assert torch.equal(got["completion_ids"], torch.tensor([[5, 2, 0, 0], [6, 7, 8, 9], [2, 0, 0, 0], [7, 2, 0, 0]]))
    assert torch.equal(got["completion_mask"], torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]))
    assert got["truncated"].tolist() == [False, True, False, False]
    assert got["logp"].dtype == torch.float32
    assert torch.equal(got["logp"], torch.tensor([[-0.5, -0.1, 0, 0], [-1., -2., -3., -4.], [-0.2, 0, 0, 0],
                                                  [-0.3, -0.4, 0, 0]]))
    # longer than max_new_tokens (cannot happen with max_tokens set, but the cut is the policy's): truncated
    long = ve._pack_outputs([RequestOutput("0", [1], [completion(0, [3] * 6, [-1.] * 6)])], n=1,
                            eos_token_id=eos, pad_token_id=pad, max_new_tokens=4)
    assert long["completion_ids"].shape == (1, 4) and long["truncated"].tolist() == [True]
    with pytest.raises(ValueError, match="returned 2 completions, expected 3"):
        ve._pack_outputs(outputs[:1], n=3, eos_token_id=eos, pad_token_id=pad, max_new_tokens=4, repeat=1)


# ------------------------------------------------------------------ generate through the engine
def script(prompt_ids, k):
    """Completion k of a prompt: [first prompt token, 10 + k, EOS] with log-probs -(k + 1) / 10 each."""
    return [prompt_ids[0], 10 + k, 2], [-(k + 1) / 10] * 3


def test_generate_passes_distinct_prompts_with_n_and_returns_prompt_major_rows():
    model, tok = make_tiny_lm()
    engine, llm = build_engine(model, tok, script=script)
    knobs = SamplingKnobs(max_new_tokens=8, temperature=0.8, top_p=0.95, top_k=0)
    got = engine.generate([[4, 5], [6]], 3, knobs, eos_token_id=2, pad_token_id=0)
    (_, prompts, params), = [c for c in llm.calls if c[0] == "generate"]
    assert prompts == [{"prompt_token_ids": [4, 5]}, {"prompt_token_ids": [6]}]  # each distinct prompt once
    assert params.n == 3 and params.top_k == -1 and params.temperature == 0.8 and params.max_tokens == 8
    expected_ids = [[p, 10 + k, 2] for p in (4, 6) for k in range(3)]
    assert got["completion_ids"].tolist() == expected_ids
    assert got["logp"][:, 0].tolist() == pytest.approx([-0.1, -0.2, -0.3] * 2)
    assert got["completion_mask"].sum().item() == 18 and not got["truncated"].any()

    greedy = engine.generate([[4, 5], [6]], 3, knobs, greedy=True, eos_token_id=2, pad_token_id=0)
    params = [c for c in llm.calls if c[0] == "generate"][-1][2]
    assert params.n == 1 and params.temperature == 0.0
    assert greedy["completion_ids"].tolist() == [[p, 10, 2] for p in (4, 6) for _ in range(3)]  # repeated n times


def test_a_seeded_call_gives_every_request_its_own_seeds_n_apart():
    """``seed``: one parameter set per distinct prompt, prompt p at ``seed + p * n`` (vLLM gives its k-th
    completion ``+ k``), so no two completions of the call share a seed; unseeded calls keep one shared set."""
    model, tok = make_tiny_lm()
    engine, llm = build_engine(model, tok, script=lambda ids, k: ([10 + k, 2], [-0.1, -0.2]))
    knobs = SamplingKnobs(max_new_tokens=4)
    got = engine.generate([[4, 5], [6], [7]], 3, knobs, eos_token_id=2, pad_token_id=0, seed=100)
    params = [c for c in llm.calls if c[0] == "generate"][-1][2]
    assert [p.seed for p in params] == [100, 103, 106] and all(p.n == 3 for p in params)
    assert got["completion_ids"][:, 0].tolist() == [110 + k for k in range(9)]  # every completion its own seed
    engine.generate([[4, 5]], 3, knobs, eos_token_id=2, pad_token_id=0)
    params = [c for c in llm.calls if c[0] == "generate"][-1][2]
    assert not isinstance(params, list) and "seed" not in params.kwargs


# ------------------------------------------------------------------ weights
def test_weight_names_plain_model_are_the_state_dict():
    model, _ = make_tiny_lm()
    pushed = dict(ve.vllm_weight_names(model))
    reference = model.state_dict()
    assert set(pushed) == set(reference)
    assert all(torch.equal(pushed[k], reference[k]) for k in reference)


def test_weight_names_skip_the_critic():
    from unialign.text.policy import CRITIC_MODULES

    assert tuple(ve.NOT_IN_ENGINE) == tuple(CRITIC_MODULES)
    model, _ = make_tiny_lm()
    names = set(model.state_dict())
    model.value_head = torch.nn.Linear(32, 1)
    assert {n for n, _ in ve.vllm_weight_names(model)} == names


def test_weight_names_lora_are_the_base_names_with_merged_values():
    peft_model, _ = lora_lm()
    base_names = set(make_tiny_lm()[0].state_dict())
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    pushed = dict(ve.vllm_weight_names(peft_model))
    assert set(pushed) == base_names
    reference = merged_state_dict(peft_model)
    assert set(reference) == base_names
    for name in base_names:
        torch.testing.assert_close(pushed[name], reference[name], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(pushed[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    # the model itself is untouched, bit for bit (no merge / unmerge round trip)
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters())


def test_push_weights_loads_merged_lora_and_leaves_the_model_as_it_was():
    peft_model, tok = lora_lm()
    engine, llm = build_engine(peft_model, tok, script=script)
    assert llm.init_kwargs["model"] == engine._tmp.name  # no local checkpoint: written to a temporary directory
    assert {"config.json", "model.safetensors"} <= set(os.listdir(engine._tmp.name))
    from safetensors.torch import load_file

    on_disk = load_file(os.path.join(engine._tmp.name, "model.safetensors"))
    reference = merged_state_dict(peft_model)
    assert set(on_disk) == set(reference)
    assert len(llm.served.loads) == 1  # pushed once at start: the engine serves the model as it is now

    with torch.no_grad():  # an optimizer step on the adapters
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.add_(0.05)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    reference = merged_state_dict(peft_model)
    engine.push_weights(peft_model)
    loaded = llm.served.loads[-1]
    assert set(loaded) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=1e-6)
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters())
    assert llm.calls[-1] == ("reset_prefix_cache",)


def test_local_checkpoint_is_served_from_its_directory(tmp_path):
    model, tok = make_tiny_lm()
    model.save_pretrained(tmp_path)
    model.name_or_path = str(tmp_path)
    engine, llm = build_engine(model, tok, script=script, gpu_memory_utilization=0.5, seed=7)
    assert engine._tmp is None and llm.init_kwargs["model"] == str(tmp_path)
    assert llm.init_kwargs["gpu_memory_utilization"] == 0.5 and llm.init_kwargs["seed"] == 7
    assert set(llm.served.loads[0]) == set(model.state_dict())


def test_sleep_discards_then_push_wakes_weights_and_generate_wakes_the_cache():
    model, tok = make_tiny_lm()
    engine, llm = build_engine(model, tok, script=script)
    kw = dict(knobs=SamplingKnobs(max_new_tokens=4), eos_token_id=2, pad_token_id=0)
    engine.sleep()
    assert llm.calls[-1] == ("sleep", 2)
    engine.sleep()  # already asleep: nothing more
    assert [c for c in llm.calls if c[0] == "sleep"] == [("sleep", 2)]
    with pytest.raises(RuntimeError, match="push_weights"):  # level 2 discarded the weights
        engine.generate([[4]], 2, **kw)
    start = len(llm.calls)
    engine.push_weights(model)
    assert llm.calls[start:] == [("wake_up", ("weights",)), ("apply_model",), ("reset_prefix_cache",)]
    engine.generate([[4]], 2, **kw)
    assert [c[0] for c in llm.calls[-2:]] == ["wake_up", "generate"] and llm.calls[-2][1] == ("kv_cache",)

    plain, llm2 = build_engine(model, tok, script=script, enable_sleep_mode=False)
    assert llm2.init_kwargs["enable_sleep_mode"] is False
    plain.sleep()
    plain.wake_up()
    assert not [c for c in llm2.calls if c[0] in ("sleep", "wake_up")]
    assert plain.generate([[4]], 2, **kw)["completion_ids"].shape == (2, 3)


def test_weight_names_gather_fsdp2_shards():
    """FSDP2 (``fully_shard``) turns parameters into DTensors: names stay, values are gathered whole
    (one gloo process here; the 2-process gather is the same ``full_tensor`` call)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already running")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        for lora in (False, True):
            model = lora_lm()[0] if lora else make_tiny_lm()[0]
            reference = merged_state_dict(model) if lora else {k: v.clone() for k, v in model.state_dict().items()}
            for layer in (model.get_base_model() if lora else model).model.layers:
                fully_shard(layer)
            fully_shard(model)
            assert isinstance(next(model.parameters()), torch.distributed.tensor.DTensor)
            pushed = dict(ve.vllm_weight_names(model))
            assert set(pushed) == set(reference)
            for name, value in reference.items():
                assert type(pushed[name]) is torch.Tensor
                torch.testing.assert_close(pushed[name], value, rtol=0, atol=1e-6)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ wired into CausalLMPolicy
def test_policy_samples_through_the_engine_pushes_weights_and_records_rollout_logps():
    """``generation_backend="vllm"`` (engine stand-in): groups go once with n, the trajectory holds the
    engine's tokens and log-probs, old log-probs are the trainer's, weights are pushed before each later
    call and the engine sleeps after each."""
    from unialign.text.policy import CausalLMPolicy
    from unialign.text.rollout import VLLMRollout

    model, tok = make_tiny_lm()
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    eos = tok.eos_token_id

    def script_digits(prompt_ids, k):
        return [digits[k], digits[(k + 3) % 10], eos], [-0.5 - k / 10, -0.25, -0.125]

    policy = CausalLMPolicy(model, tok, max_new_tokens=6)
    policy.rollout = VLLMRollout({})  # the constructor refuses vllm on this CPU machine
    policy.rollout.engine, llm = build_engine(model, tok, script=script_digits)
    policy.rollout.fresh = True
    prompts = ["1+2?"] * 3 + ["what is 33+4?"] * 3
    traj = policy.sample(prompts)
    generate_calls = [c for c in llm.calls if c[0] == "generate"]
    assert len(generate_calls) == 1 and generate_calls[0][2].n == 3 and len(generate_calls[0][1]) == 2
    assert traj.completions == ["03", "14", "25"] * 2
    assert traj.mask_B_T.sum(-1).tolist() == [3.0] * 6 and not traj.truncated_B.any()
    assert traj.rollout_logp_B_T[:, 0].tolist() == pytest.approx([-0.5, -0.6, -0.7] * 2)
    with torch.no_grad():  # old log-probs: the trained model's own forward, not the engine's
        assert torch.allclose(traj.old_logp_B_T, policy.log_prob(traj))
    assert ("sleep", 2) in llm.calls and len(llm.served.loads) == 1  # the push at build only
    policy.sample(prompts)
    assert len(llm.served.loads) == 2  # pushed again before the second call
    uneven = policy.sample(["1+2?", "1+2?", "7-2?"])  # runs of unequal length: one by one
    assert [c for c in llm.calls if c[0] == "generate"][-1][2].n == 1 and len(uneven) == 3
    with pytest.raises(RuntimeError, match="CUDA"):
        CausalLMPolicy(model, tok, generation_backend="vllm")


def test_the_vllm_path_ends_completions_at_stop_strings_itself():
    """The engine runs without a tokenizer, so vLLM is not given the stop strings; the policy ends what it
    returns at them, as on the HF path, and the cut tokens carry no rollout log-prob."""
    from unialign.text.policy import CausalLMPolicy
    from unialign.text.rollout import VLLMRollout
    from unialign.text.sampling import SamplingKnobs

    model, tok = make_tiny_lm()
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]

    def script(prompt_ids, k):
        return [digits[k], digits[3], digits[5], tok.eos_token_id], [-0.5, -0.25, -0.125, -0.1]

    policy = CausalLMPolicy(model, tok, sampling=SamplingKnobs(max_new_tokens=6, stop=("3",)))
    policy.rollout = VLLMRollout({})
    policy.rollout.engine, llm = build_engine(model, tok, script=script)
    policy.rollout.fresh = True
    traj = policy.sample(["1+2?"] * 2)
    params = [c for c in llm.calls if c[0] == "generate"][-1][2]
    assert not getattr(params, "stop", None) and params.detokenize is False
    assert traj.completions == ["0", "1"] and not traj.truncated_B.any()
    assert traj.mask_B_T.sum(-1).tolist() == [2.0, 2.0]
    assert traj.rollout_logp_B_T.tolist() == [[-0.5, -0.25, 0.0, 0.0]] * 2
