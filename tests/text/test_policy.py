"""CausalLMPolicy: recorded log-probs, fused head vs naive logits, reference, LoRA, masks."""

from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def input_shapes(model):
    """Records the ``input_ids`` shape of every forward of ``model``."""
    shapes: list[tuple[int, ...]] = []
    hook = model.register_forward_hook(lambda m, a, k, out: shapes.append(tuple(k["input_ids"].shape)),
                                       with_kwargs=True)
    try:
        yield shapes
    finally:
        hook.remove()


def test_shared_prompt_prefix_equals_the_full_pass_in_values_and_gradients():
    """Each distinct prompt runs once and its KV cache is gathered to the samples: logp, entropy, the
    shared value head and every gradient equal the standard full-sequence pass."""
    model, tok = make_tiny_lm()
    policy = CausalLMPolicy(model, tok, max_new_tokens=8, value_head=True)
    with torch.no_grad():
        policy.value_head.weight.normal_()
    torch.manual_seed(3)
    prompts = ["1+2?", "what is 33+4? be quick", "7-2?"]
    traj = policy.sample([p for p in prompts for _ in range(3)])
    traj = traj.select(torch.randperm(len(traj)))  # groups interleaved, as after the trainer's shuffle
    w = torch.randn_like(traj.mask_B_T)
    results = {}
    for share in (True, False):
        policy.share_prompt_prefix = share
        with input_shapes(model) as calls:
            logp, entropy, values = policy.log_prob_and_values(traj)
        model.zero_grad()
        ((logp + 0.1 * entropy + values) * w).sum().backward()
        results[share] = (logp.detach(), entropy.detach(), values.detach(),
                          {n: p.grad.clone() for n, p in model.named_parameters()}, calls)
    (lp, en, va, gr, calls), (lp0, en0, va0, gr0, calls0) = results[True], results[False]
    T = traj.payload["completion_ids"].shape[1]
    assert calls[0][0] == 3 and calls[1] == (9, T + 1) and calls0[0][0] == 9 and len(calls0) == 1
    assert_close(lp, lp0)
    assert_close(en, en0)
    assert_close(va, va0)
    for n in gr0:  # relative to each tensor's scale: sums over positions are re-ordered (embeddings)
        scale = gr0[n].abs().max().clamp(min=1e-30)
        assert_close(gr[n] / scale, gr0[n] / scale, msg=n)


def test_generation_prefills_each_distinct_prompt_once_and_samples_the_same_tokens():
    model, tok = make_tiny_lm()
    policy = CausalLMPolicy(model, tok, max_new_tokens=12)
    prompts = [p for p in ["1+2?", "what is 33+4? be quick", "7-2?"] for _ in range(4)]
    outs = {}
    for share in (True, False):
        policy.share_prompt_prefix = share
        with input_shapes(model) as shapes:
            torch.manual_seed(0)
            sampled = policy.generate(prompts)["completion_ids"]
            greedy = policy.generate(prompts, greedy=True)["completion_ids"]
        outs[share] = (sampled, greedy, shapes)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    width = policy._encode_prompts(prompts)["input_ids"].shape[1]
    assert outs[True][2][:2] == [(3, width - 1), (12, 1)]  # distinct prompts once, then one token per sample
    assert outs[False][2][0] == (12, width)


def test_prefix_sharing_steps_aside_under_gradient_checkpointing_and_for_distinct_prompts():
    model, tok = make_tiny_lm()
    policy = CausalLMPolicy(model, tok, max_new_tokens=6)
    torch.manual_seed(0)
    traj = policy.sample(["1+2?", "1+2?", "what is 33+4?"])
    width = traj.payload["prompt_ids"].shape[1] + traj.payload["completion_ids"].shape[1]
    model.gradient_checkpointing_enable()
    model.train()
    with input_shapes(model) as shapes:
        policy.log_prob(traj)
    assert shapes == [(3, width)]  # one full pass: no KV cache while checkpointing
    model.gradient_checkpointing_disable()
    distinct = policy.sample(["1+2?", "what is 33+4?"])
    with input_shapes(model) as shapes:
        policy.log_prob(distinct)
    assert len(shapes) == 1  # nothing repeats: nothing to share


def test_static_generation_cache_samples_the_same_tokens_in_one_reused_fixed_size_cache():
    """``generation_cache="static"`` (CUDA graphs on GPU): the same greedy and sampled tokens as the
    default path, from ONE fixed-size cache (max_prompt_length + max_new_tokens) whose tensors keep their
    addresses across calls and prompt widths (what lets captured graphs replay); a new batch size
    replaces it."""
    import pytest

    model, tok = make_tiny_lm()
    prompts = [p for p in ["1+2?", "what is 33+4? be quick", "7-2?"] for _ in range(3)]
    outs = {}
    for mode in ("dynamic", "static"):
        policy = CausalLMPolicy(model, tok, max_new_tokens=10, max_prompt_length=40, generation_cache=mode)
        caches = []
        hook = model.register_forward_hook(
            lambda m, a, k, out, seen=caches: seen.append(out["cache"] if "cache" in out else out.past_key_values),
            with_kwargs=True)
        try:
            torch.manual_seed(0)
            outs[mode] = (policy.generate(prompts)["completion_ids"], policy.generate(prompts, greedy=True)["completion_ids"],
                          policy.generate(["1+2?"] * 9, greedy=True)["completion_ids"])  # narrower prompts
        finally:
            hook.remove()
        assert {type(c).__name__ for c in caches} == ({"StaticCache"} if mode == "static" else {"DynamicCache"})
        if mode == "static":
            assert len({id(c) for c in caches}) == 1 and caches[0].get_max_length() == 40 + 10
            ptrs = {(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in caches[0].layers}
            policy.generate(["what is 33+4? be quick"] * 9, greedy=True)  # another prompt width, same batch size
            assert {(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in caches[0].layers} == ptrs
            f32 = torch.float32
            held = policy.hf_rollout.static_caches
            first = held[(9, f32)][1]
            policy.generate(prompts[:4], greedy=True)  # another batch size: a cache of its own
            assert held[(4, f32)][1] is not first and held[(9, f32)][1] is first
            policy.generate(prompts[:2], greedy=True)  # a third: the least recently used (9) goes
            assert list(held) == [(4, f32), (2, f32)]
    for a, b in zip(outs["dynamic"], outs["static"]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="generation_cache"):
        CausalLMPolicy(model, tok, generation_cache="paged")
    auto = CausalLMPolicy(model, tok, max_new_tokens=4)  # "auto" on CPU: the dynamic path
    assert auto.generation_cache == "auto" and not auto.hf_rollout.uses_static_cache(auto, model)
    auto.generate(["1+2?"] * 2)
    assert auto.hf_rollout.static_caches == {}


def test_a_roomy_decoding_cache_writes_in_place_and_holds_what_concatenation_holds():
    """``prefix.reserve_room``: a filled ``DynamicCache``'s layers take the next tokens in place (the same buffer
    while they fit), hold exactly what transformers' concatenating layer holds, and reserve again past their room
    or after a reorder (beam search's ``reorder_cache``: a fresh tensor); cropping keeps the buffer."""
    import copy as copy_

    from transformers import DynamicCache

    from unialign.text.prefix import reserve_room

    model, _ = make_tiny_lm()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(4, 40, (3, 5)), use_cache=True).past_key_values
    plain = copy_.deepcopy(cache)
    assert isinstance(cache, DynamicCache) and reserve_room(cache, 3) is cache
    assert {type(layer).__name__ for layer in cache.layers} == {"RoomyLayer"}
    ptr = cache.layers[0].keys_buffer.data_ptr()
    B, H, _, D = cache.layers[0].keys.shape

    def step(n=1):
        k, v = torch.randn(B, H, n, D), torch.randn(B, H, n, D)
        for i in range(len(cache.layers)):
            a, b = cache.update(k, v, i), plain.update(k, v, i)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    step()
    step(2)
    assert cache.layers[0].keys_buffer.data_ptr() == ptr and cache.get_seq_length() == 8  # 5 + 3: in place
    step()  # past the room: reserved again, still the same numbers
    assert cache.layers[0].keys_buffer.data_ptr() != ptr and cache.get_seq_length() == 9
    order = torch.tensor([2, 0, 1])
    cache.reorder_cache(order)
    plain.reorder_cache(order)
    step()
    cache.crop(-2)
    plain.crop(-2)
    step(2)
    assert cache.get_seq_length() == plain.get_seq_length() == 10


def test_the_prefix_gather_s_backward_is_autograd_s_own_bit_for_bit():
    """``prefix.gather_rows``: index_select forward; backward summing a strided gradient (a cache read through
    ``torch.cat``) to the same bits as autograd's own index_select backward."""
    from unialign.text.prefix import gather_rows

    torch.manual_seed(0)
    index = torch.arange(4).repeat_interleave(3)[torch.randperm(12)]
    src = torch.randn(4, 2, 7, 8, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(12, 2, 11, 8)[:, :, :7]  # strided, like a slice of cat's gradient
    ours = gather_rows(src, index)
    assert torch.equal(ours, src.index_select(0, index))
    ours.backward(grad)
    mine, src.grad = src.grad, None
    src.index_select(0, index).backward(grad)
    assert torch.equal(mine, src.grad)
    assert not gather_rows(src.detach(), index).requires_grad
