"""Rollout engines: where ``CausalLMPolicy.sample`` gets its completions from.

Each is a ``RolloutEngine``: ``generate(policy, prompts, greedy, max_new_tokens)`` returns the policy's
``generate`` dict. ``HFRollout`` runs transformers ``generate`` on the trained model (or a given module),
with a dynamic KV cache (repeated prompts prefilled once, room reserved for the completion) or a static one (CUDA graphs);
``LowPrecisionRollout`` (``rollout_dtype``) refreshes a low-precision copy of the policy and samples from it
through an ``HFRollout``; ``VLLMRollout`` (``generation_backend="vllm"``) samples from a vLLM engine
colocated in this process (``unialign.text.vllm_engine``). ``build_rollout`` checks the policy's options
and picks one.

An engine holds state only (KV caches, the copy, the vLLM engine). The sampling settings are the policy's
(``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``max_prompt_length``, ``generation_cache``,
``share_prompt_prefix``, ``tokenizer``), read at every call, so a setting changed on the policy applies to
the next call; prompts are encoded by ``policy._encode_prompts`` and the shared prompt prefill is
``policy._prompt_cache``.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch

from unialign.dist import gathered_fsdp2_root, unwrap
from unialign.text.prefix import cache_kwarg, reserve_room, right_align
from unialign.text.sampling import DecodeLogProbs, first_stop, stop_lengths

PAYLOAD_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


class RolloutEngine(Protocol):
    def generate(self, policy: Any, prompts: list[Any], greedy: bool = False,
                 max_new_tokens: int | None = None, generator: torch.Generator | None = None) -> dict:
        """Completions of ``prompts`` (one per prompt; repeat prompts for groups) by ``policy`` (a
        ``CausalLMPolicy``), drawn from ``generator`` when given (else torch's global RNG): ``prompt_ids`` /
        ``prompt_mask`` [B, W] (left-padded), ``completion_ids`` / ``completion_mask`` [B, T] (right-padded; tokens
        up to and including the first EOS), ``truncated`` [B]
        (no EOS within ``max_new_tokens``, default the policy's), ``texts`` (decoded, without special tokens)
        and, from an engine other than the trained model, ``rollout_logp`` [B, T]: that engine's log-probs of
        the sampled tokens; ``payload``: what the policy's ``_generate_inputs`` keeps for the trajectory beside
        the token tensors (a VLM's images), when anything."""
        ...


def build_rollout(generation_backend: str, rollout_dtype: str | None, generation_cache: str,
                  vllm_options: dict[str, Any], hf: HFRollout) -> RolloutEngine:
    """The engine ``sample`` uses for the policy's options, checked first (``ValueError`` naming the option;
    ``RuntimeError`` when vLLM cannot run here): ``hf`` itself, a ``LowPrecisionRollout`` over it, or a
    ``VLLMRollout`` with ``vllm_options``."""
    if generation_backend not in ("hf", "vllm"):
        raise ValueError(f"generation_backend must be 'hf' or 'vllm', got {generation_backend!r}")
    if generation_backend == "vllm":
        if rollout_dtype is not None:
            raise ValueError("rollout_dtype applies to the hf backend; vLLM samples in its own dtype")
        from unialign.text.vllm_engine import check_vllm_available

        check_vllm_available()
    if rollout_dtype is not None and rollout_dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"rollout_dtype must be bfloat16, float16 or float32, got {rollout_dtype!r}")
    if generation_cache not in ("auto", "dynamic", "static"):
        raise ValueError(f"generation_cache must be 'auto', 'dynamic' or 'static', got {generation_cache!r}")
    if generation_backend == "vllm":
        return VLLMRollout(vllm_options)
    return hf if rollout_dtype is None else LowPrecisionRollout(rollout_dtype, hf)


def finish_completions(completion: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor, tokenizer: Any,
                       stop: tuple[str, ...]) -> dict:
    """An engine's completions ended by EOS -- ``completion`` long [B, T] (pad after the kept tokens), ``mask``
    long [B, T] (1 on kept tokens, the EOS included), ``truncated`` bool [B] -- ended again at the first
    ``stop`` string (``unialign.text.sampling``): the tokens after the one completing it padded and masked, the
    row no longer truncated, its text ending before the stop string. Returns ``completion_ids``,
    ``completion_mask``, ``truncated`` and ``texts`` (the kept tokens decoded without special tokens)."""
    pad = tokenizer.pad_token_id
    shown = completion.masked_fill((completion == tokenizer.eos_token_id) | (mask == 0), pad)
    texts = tokenizer.batch_decode(shown, skip_special_tokens=True)
    if stop:
        rows = [row[m.bool()].tolist() for row, m in zip(shown, mask)]
        kept = stop_lengths(rows, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop)
        completion, mask, truncated = completion.clone(), mask.clone(), truncated.clone()
        for i, k in enumerate(kept):
            if k is not None:
                completion[i, k:], mask[i, k:], truncated[i] = pad, 0, False
                texts[i] = texts[i][:first_stop(texts[i], stop)]
    return {"completion_ids": completion, "completion_mask": mask, "truncated": truncated, "texts": texts}


class HFRollout:
    """transformers ``generate`` (left padding, EOS handling, temperature / top-p / top-k) with the KV cache
    the policy's ``generation_cache`` names: ``"dynamic"`` (transformers' default KV cache; repeated prompts
    are prefilled once, ``policy._prompt_cache``, when ``share_prompt_prefix``) or ``"static"``: a fixed-size
    KV cache, for which transformers compiles the decoding forward on CUDA (CUDA graphs: the per-token kernel
    launches of a small model cost more than its maths; the measured speed-up is in docs/scaling.md).
    ``"auto"``: static when the model is on CUDA, dynamic elsewhere (on CPU nothing is compiled and the
    shared prompt prefill wins). Its size is ``max_prompt_length + max_new_tokens`` when a prompt limit is
    set, else the prompt width rounded up to 128 (it only grows, so recompilations stay rare); one is kept
    per batch size (the two most recent: training and held-out batches), which costs their memory during
    training. Same tokens either way."""

    def __init__(self):
        # (batch, dtype) -> (length, cache), newest last
        self.static_caches: dict[tuple, tuple[int, Any]] = {}

    @torch.no_grad()
    def generate(self, policy: Any, prompts: list[Any], greedy: bool = False,
                 max_new_tokens: int | None = None, model: torch.nn.Module | None = None,
                 generator: torch.Generator | None = None, record_logp: bool = False) -> dict:
        """``RolloutEngine.generate`` on ``model``, default the policy's trained one (unwrapped): another module
        with the same tokenizer to sample from (the rollout copy). ``generator``: sample from it rather than
        torch's global RNG (``SamplingKnobs.seeded_kwargs``; the same distribution, other draws).
        ``record_logp`` (with a ``generator``, or greedy): also ``decode_logp`` [B, T], each sampled token's
        log-probability as decoding computed it (``sampling.DecodeLogProbs``; what a scoring forward would give,
        up to float rounding)."""
        tokenizer = policy.tokenizer
        enc = policy._encode_prompts(prompts)
        model = unwrap(policy.model) if model is None else model
        was_training = model.training
        model.eval()
        eos = tokenizer.eos_token_id
        knobs = policy.sampling.with_(max_new_tokens=max_new_tokens or policy.max_new_tokens)
        sampling = knobs.seeded_kwargs(generator) if generator is not None and not greedy else knobs.hf_kwargs(greedy)
        gen_kwargs = dict(**sampling, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
        recorder = None
        if record_logp:
            if "logits_processor" not in sampling and not greedy:
                raise ValueError("record_logp: decoding log-probs are recorded when sampling from a generator")
            if knobs.repetition_penalty != 1.0:
                raise ValueError("record_logp: the repetition penalty changes the scores the trainer does not")
            from transformers import LogitsProcessorList

            recorder = DecodeLogProbs(knobs.temperature)
            gen_kwargs["logits_processor"] = LogitsProcessorList([recorder, *sampling.get("logits_processor", [])])
        if knobs.stop:
            gen_kwargs["tokenizer"] = tokenizer  # generate reads the stop strings' tokens from it
        batch, prompt_width = enc["input_ids"].shape
        if self.uses_static_cache(policy, model):
            width = policy.max_prompt_length or -(-prompt_width // 128) * 128
            gen_kwargs.update(self.static_cache(model, batch, width + gen_kwargs["max_new_tokens"]))
        elif policy.share_prompt_prefix:  # repeated prompts (GRPO groups): prefill each distinct prompt once
            prompt_cache = policy._prompt_cache(model, *right_align(enc["input_ids"], enc["attention_mask"]))
            for cache in (prompt_cache or {}).values():  # decoding writes in place: no copy of the cache per token
                reserve_room(cache, 1 + gen_kwargs["max_new_tokens"])
            gen_kwargs.update(prompt_cache or {})
        inputs, extras = policy._generate_inputs(enc)
        with gathered_fsdp2_root(model):  # peft's generate skips the root forward that would unshard it
            out = model.generate(**inputs, **gen_kwargs)
        model.train(was_training)
        completion = out[:, prompt_width:]
        is_eos = completion == eos
        # keep tokens up to and including the first EOS
        after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
        ends = finish_completions(completion.masked_fill(after_eos, tokenizer.pad_token_id), (~after_eos).long(),
                                  ~is_eos.any(-1), tokenizer, knobs.stop)
        if recorder is not None:
            ends["decode_logp"] = recorder.logp(out) * ends["completion_mask"]
        return {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"], **ends,
                **({"payload": extras} if extras else {})}

    @staticmethod
    def uses_static_cache(policy: Any, model: torch.nn.Module) -> bool:
        if policy.generation_cache == "auto":
            return next(model.parameters()).device.type == "cuda"
        return policy.generation_cache == "static"

    def static_cache(self, model: torch.nn.Module, batch: int, length: int) -> dict:
        """The ``generate`` kwarg holding a fixed-size KV cache for ``batch`` rows of up to ``length`` tokens.

        One cache object is kept and ``reset()`` (zeroed in place) between calls, so its tensors keep their
        addresses: transformers marks them static for the compiled decoding step, and CUDA graphs replay
        only while those addresses stay put (a fresh cache per call, transformers' own
        ``cache_implementation="static"``, re-records the graphs every batch). One cache per batch size
        (and model dtype), the two most recently used kept (so held-out batches do not evict the training
        one); a longer length replaces that batch size's cache (the longest length seen is kept)."""
        from transformers import StaticCache

        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        key = (batch, next(model.parameters()).dtype)  # a rollout copy in another dtype gets its own
        held = self.static_caches.pop(key, None)
        if held is not None and held[0] >= length:
            held[1].reset()
        else:
            length = max(length, held[0]) if held is not None else length
            held = (length, StaticCache(config=lm.config.get_text_config(decoder=True), max_cache_len=length))
        self.static_caches[key] = held  # newest last
        while len(self.static_caches) > 2:
            self.static_caches.pop(next(iter(self.static_caches)))
        return {cache_kwarg(lm): held[1]}


class LowPrecisionRollout:
    """``rollout_dtype`` (``"bfloat16"`` / ``"float16"``): sample from a copy of the policy in that dtype,
    refreshed from the trained weights before every sampling call, and record its log-probs of the sampled
    tokens (``rollout_logp``, the policy's ``Trajectory.rollout_logp_B_T``) -- a real rollout/trainer
    mismatch, like an inference engine's, for the trainer's importance-sampling correction
    (``algos.rollout_correction``); ``old_logp_B_T`` stays the trainer's own. Held-out greedy evaluation
    (``policy.generate``) uses the trained model."""

    def __init__(self, dtype: str, hf: HFRollout):
        self.dtype, self.hf = getattr(torch, dtype), hf
        self.copy: torch.nn.Module | None = None

    @torch.no_grad()
    def refresh(self, source: torch.nn.Module) -> torch.nn.Module:
        """The copy with ``source``'s weights pushed into it (one in-place copy per call; built on first
        use)."""
        if self.copy is None:
            self.copy = copy.deepcopy(source).to(self.dtype).eval()
            self.copy.requires_grad_(False)
        else:
            for dst, src in zip(self.copy.parameters(), source.parameters()):
                dst.copy_(src)
        return self.copy

    def generate(self, policy: Any, prompts: list[Any], greedy: bool = False,
                 max_new_tokens: int | None = None, generator: torch.Generator | None = None) -> dict:
        rollout = self.refresh(unwrap(policy.model))
        g = self.hf.generate(policy, prompts, greedy, max_new_tokens, model=rollout, generator=generator)
        with torch.no_grad():
            payload = {**{k: g[k] for k in PAYLOAD_KEYS}, **g.get("payload", {})}
            g["rollout_logp"], _, _ = policy._forward(rollout, payload, False)
        return g


class VLLMRollout:
    """``generation_backend="vllm"``: rollouts from a vLLM engine colocated in this process
    (``unialign.text.vllm_engine.VLLMEngine``, options ``vllm_options`` such as ``gpu_memory_utilization``),
    built on the first call; each distinct prompt of a group is sent once with ``n`` = the group size; the
    sampling policy's weights (the trained ones, or an async rollout copy's: ``CausalLMPolicy.sampling_view``)
    are pushed before every call and, with ``sleep_after``, the engine sleeps (frees its GPU memory) after it,
    through the update. Its log-probs are ``rollout_logp``. Needs CUDA and vllm (``build_rollout`` checks)."""

    def __init__(self, options: dict[str, Any], engine: Any = None, sleep_after: bool = True):
        self.options = options
        self.engine: Any = engine
        self.fresh = False  # the engine holds the current weights (just built)
        self.sleep_after = sleep_after  # off for async rollouts: the engine samples while the update runs

    def generate(self, policy: Any, prompts: list[Any], greedy: bool = False,
                 max_new_tokens: int | None = None, generator: torch.Generator | None = None) -> dict:
        """Runs of identical prompts (a GRPO group) go once with ``n`` = the run length when all runs are
        equally long, else one by one. vLLM draws from its own RNG, or with a ``generator`` (a batch's own, async
        rollouts) from per-request seeds the generator draws (``VLLMEngine.generate``'s ``seed``): the same
        generator state, the same samples, whatever the engine ran before."""
        from unialign.text.vllm_engine import VLLMEngine

        tokenizer = policy.tokenizer
        enc = policy._encode_prompts(prompts)
        ids = [row[m.bool()].tolist() for row, m in zip(enc["input_ids"], enc["attention_mask"])]
        starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
        runs = {b - a for a, b in zip(starts, [*starts[1:], len(ids)])}
        n = runs.pop() if len(runs) == 1 else 1
        distinct = [ids[i] for i in starts] if n > 1 else ids
        if self.engine is None:
            self.engine = VLLMEngine(unwrap(policy.model), tokenizer, **self.options)
        elif not self.fresh:
            self.engine.push_weights(unwrap(policy.model))
        self.fresh = False
        knobs = policy.sampling.with_(max_new_tokens=max_new_tokens or policy.max_new_tokens)
        seed = None
        if generator is not None:  # room below 2**31 for the call's P * n consecutive seeds
            seed = int(torch.randint(0, 2 ** 31 - len(distinct) * n, (), generator=generator, device=generator.device))
        out = self.engine.generate(distinct, n, knobs, greedy=greedy, eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id, seed=seed)
        if self.sleep_after:
            self.engine.sleep()  # its GPU memory goes back to the update; the next call pushes and wakes it
        device = enc["input_ids"].device
        ends = finish_completions(out["completion_ids"].to(device), out["completion_mask"].long().to(device),
                                  out["truncated"].to(device), tokenizer, knobs.stop)
        logp = out["logp"].to(device) * ends["completion_mask"]  # 0 on the tokens a stop string cut off
        return {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"], **ends, "rollout_logp": logp}
