"""``CausalLMPolicy``: a transformers causal LM behind the ``Policy`` protocol.

A step is a generated token. ``sample`` runs ``generate`` (left padding, EOS handling,
temperature / top-p / top-k) and records the completion mask, truncation flags and the
log-probs of the sampled tokens; ``log_prob`` recomputes them differentiably through the fused
head (no [B, T, V] logits). Sampling-time log-probs are computed by the same module and kernel
as training log-probs, so the first on-policy ratio is 1 up to batching noise (TRL #4159 is
what happens otherwise).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from unialign.dist import fsdp2_root as _fsdp2_root
from unialign.dist import gathered_fsdp2_root as _gathered_fsdp2_root
from unialign.dist import gathered_state_dict, is_main_rank, unwrap
from unialign.hub import hub_error, require_hub
from unialign.policy import ReferencePolicy
from unialign.text.head import install_fused_head
from unialign.text.tokens import encode_prompts
from unialign.types import PreferenceBatch, Trajectory
from unialign.weights import check_finite

CHAT_TEMPLATE_MODES = ("auto", "always", "never")


def templated(mode: str, prompt: Any) -> bool:
    """TRL's rule for ``mode`` "auto" (a conversation through the chat template, a string raw), or always / never."""
    return mode == "always" or (mode == "auto" and not isinstance(prompt, str))


def messages_text(messages: list[dict[str, Any]]) -> str:
    """A conversation without a template: its messages' text contents joined by blank lines."""
    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "\n\n".join(text(m["content"]) for m in messages)


class CausalLMPolicy:
    """Policy over token sequences. ``model`` may be wrapped (DDP / FSDP) by the trainer."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_prompt_length: int | None = None,
        chat_template: str = "auto",
        system_prompt: str | None = None,
        chunk_size: int = 1024,
        value_head: bool | str = False,
        share_prompt_prefix: bool = True,
        generation_cache: str = "auto",
        rollout_dtype: str | None = None,
        generation_backend: str = "hf",
        vllm_options: dict[str, Any] | None = None,
    ):
        """``value_head`` (PPO's critic): ``False``; ``True`` / ``"shared"``: a zero-initialised scalar
        head on the policy's backbone; ``"separate"``: a critic with its own copy of the backbone;
        any other string: a sequence-classification checkpoint (e.g. the reward model, as InstructGPT
        initialises its value model) whose backbone and score head become the critic.
        ``chat_template`` (TRL's rule): ``"auto"``: a string prompt (TRL's standard format) is used raw, a list
        of messages (conversational) goes through the tokenizer's chat template; ``"always"``: a string is sent
        as one user message through the template too (after ``system_prompt``); ``"never"``: no template, a
        conversation's message contents joined by blank lines. A conversation with a tokenizer that has no chat
        template is a ``ValueError`` naming ``chat_template``.
        ``share_prompt_prefix``: compute each distinct prompt once per forward (``_prompt_cache``).
        ``generation_cache``: ``"dynamic"`` (transformers' default KV cache; repeated prompts are prefilled
        once) or ``"static"``: a fixed-size KV cache, for which transformers compiles the decoding forward
        on CUDA (CUDA graphs: the per-token kernel launches of a small model cost more than its maths; the
        measured speed-up is in docs/scaling.md). ``"auto"`` (default): static when the model is
        on CUDA, dynamic elsewhere (on CPU nothing is compiled and the shared prompt prefill wins).
        Its size is ``max_prompt_length + max_new_tokens`` when a prompt limit is set, else the prompt
        width rounded up to 128 (it only grows, so recompilations stay rare); one is kept per batch size
        (the two most recent: training and held-out batches), which costs their memory during training.
        Same tokens either way.
        ``rollout_dtype`` (``"bfloat16"`` / ``"float16"``): sample from a copy of the policy in that dtype,
        refreshed from the trained weights before every sampling call, and record its log-probs of the
        sampled tokens in ``Trajectory.rollout_logp_B_T`` -- a real rollout/trainer mismatch, like an
        inference engine's, for the trainer's importance-sampling correction (``algos.rollout_correction``);
        ``old_logp_B_T`` stays the trainer's own. Held-out greedy evaluation uses the trained model.
        ``generation_backend``: ``"hf"`` (transformers ``generate``) or ``"vllm"``: rollouts from a vLLM engine
        colocated in this process (``unialign.text.vllm_engine.VLLMEngine``, options ``vllm_options`` such as
        ``gpu_memory_utilization``), built on the first ``sample``; each distinct prompt of a group is sent
        once with ``n`` = the group size; the trained weights are pushed before every sampling call and the
        engine sleeps (frees its GPU memory) after it, through the update. Its log-probs go to
        ``rollout_logp_B_T``. Needs CUDA and vllm: checked here, before anything is built."""
        if generation_backend not in ("hf", "vllm"):
            raise ValueError(f"generation_backend must be 'hf' or 'vllm', got {generation_backend!r}")
        if generation_backend == "vllm":
            if rollout_dtype is not None:
                raise ValueError("rollout_dtype applies to the hf backend; vLLM samples in its own dtype")
            from unialign.text.vllm_engine import check_vllm_available

            check_vllm_available()
        self.generation_backend, self.vllm_options = generation_backend, dict(vllm_options or {})
        self._engine: Any = None
        self._engine_fresh = False  # the engine holds the current weights (just built)
        if rollout_dtype is not None and rollout_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"rollout_dtype must be bfloat16, float16 or float32, got {rollout_dtype!r}")
        self.rollout_dtype = rollout_dtype
        self._rollout_copy: torch.nn.Module | None = None
        if generation_cache not in ("auto", "dynamic", "static"):
            raise ValueError(f"generation_cache must be 'auto', 'dynamic' or 'static', got {generation_cache!r}")
        self.share_prompt_prefix = share_prompt_prefix
        self.generation_cache = generation_cache
        self._held_static_caches: dict[tuple, tuple[int, Any]] = {}  # (batch, dtype) -> (length, cache), newest last
        self.head = install_fused_head(unwrap(model).get_base_model() if hasattr(unwrap(model), "get_base_model")
                                       else unwrap(model), chunk_size)
        self.model = model
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.max_prompt_length = max_prompt_length
        if chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {chat_template!r}")
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.value_head: torch.nn.Module | None = None  # shared critic: a head on the policy's last hidden state
        self.value_model: ValueModel | None = None       # separate critic: its own backbone and head
        if value_head:
            base = unwrap(model).get_base_model() if hasattr(unwrap(model), "get_base_model") else unwrap(model)
            if value_head in (True, "shared"):
                if not hasattr(base, "value_head"):
                    base.value_head = _zero_linear(base.config.hidden_size, self.head.weight.device)
                self.value_head = base.value_head
            else:  # attached to the policy's module, so the trainer's optimizer and wrapper see it
                if not hasattr(base, "value_model"):
                    base.value_model = ValueModel.build(base, value_head)
                self.value_model = base.value_model
        self._frozen_copy: torch.nn.Module | None = None

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, name_or_path: str, lora_rank: int = 0, lora_alpha: int | None = None,
                        lora_target_modules: list[str] | None = None, torch_dtype: str = "float32",
                        trust_remote_code: bool = False, **kwargs) -> CausalLMPolicy:
        """Load a causal LM and tokenizer by hub id or local directory; optional LoRA through peft.
        Fails at once with a clear message when the weights are not reachable (offline)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if kwargs.get("generation_backend") == "vllm":  # before any weights load
            from unialign.text.vllm_engine import check_vllm_available

            check_vllm_available()
        require_hub(name_or_path, "model")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=getattr(torch, torch_dtype), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise hub_error(name_or_path, err) from None
        check_finite(model, name_or_path)  # NaN / inf weights: refused now, by tensor name
        install_fused_head(model, kwargs.get("chunk_size", 1024))
        if lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=lora_rank, lora_alpha=lora_alpha or 2 * lora_rank, task_type="CAUSAL_LM",
                target_modules=lora_target_modules or "all-linear"))
        return cls(model, tokenizer, **kwargs)

    # ---------------------------------------------------------------- prompts
    def is_templated(self, prompt: Any) -> bool:
        """Whether ``format_prompt`` renders ``prompt`` through the chat template (which carries the BOS
        the model wants) rather than as raw text (which gets the tokenizer's own, ``unialign.text.tokens``)."""
        return templated(self.chat_template, prompt)

    def format_prompt(self, prompt: Any) -> str:
        """A string prompt, or a list of chat messages, as the text the model is conditioned on."""
        if not self.is_templated(prompt):
            return prompt if isinstance(prompt, str) else messages_text(prompt)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("a conversational prompt (a list of messages) needs a chat template, and the model's "
                             "tokenizer has none: pass --chat_template never to use the messages' text raw")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if self.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _encode_prompts(self, prompts: list[Any]) -> dict[str, torch.Tensor]:
        """Left-padded prompt ids and mask [B, W], special tokens as the model expects them
        (``unialign.text.tokens.encode_prompts``: BOS on raw text where the tokenizer adds one, none
        added to a chat template's output). Sampling, the training forward (the ids are kept in the
        trajectory), evaluation and the pair losses all go through here."""
        enc = encode_prompts(self.tokenizer, [self.format_prompt(p) for p in prompts],
                             [self.is_templated(p) for p in prompts], max_length=self.max_prompt_length,
                             padding_side="left")
        return {k: v.to(self.device) for k, v in enc.items()}

    @property
    def device(self) -> torch.device:
        return next(unwrap(self.model).parameters()).device

    # ---------------------------------------------------------------- sampling
    @torch.no_grad()
    def generate(self, prompts: list[Any], greedy: bool = False, max_new_tokens: int | None = None,
                 model: torch.nn.Module | None = None) -> dict:
        """Generate completions; returns ids, masks, truncation flags and decoded texts (no log-probs).
        ``model``: another module with the same tokenizer to sample from (the rollout copy)."""
        enc = self._encode_prompts(prompts)
        model = unwrap(self.model) if model is None else model
        was_training = model.training
        model.eval()
        eos = self.tokenizer.eos_token_id
        gen_kwargs = dict(do_sample=not greedy, max_new_tokens=max_new_tokens or self.max_new_tokens,
                          pad_token_id=self.tokenizer.pad_token_id, eos_token_id=eos)
        if not greedy:
            gen_kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        if self._use_static_cache(model):
            width = self.max_prompt_length or -(-enc["input_ids"].shape[1] // 128) * 128
            gen_kwargs.update(self._static_cache(model, enc["input_ids"].shape[0], width + gen_kwargs["max_new_tokens"]))
        elif self.share_prompt_prefix:  # repeated prompts (GRPO groups): prefill each distinct prompt once
            gen_kwargs.update(self._prompt_cache(model, *_right_align(enc["input_ids"], enc["attention_mask"])) or {})
        with _gathered_fsdp2_root(model):  # peft's generate skips the root forward that would unshard it
            out = model.generate(**enc, **gen_kwargs)
        model.train(was_training)
        prompt_width = enc["input_ids"].shape[1]
        completion = out[:, prompt_width:]
        is_eos = completion == eos
        # keep tokens up to and including the first EOS
        after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
        mask = (~after_eos).long()
        truncated = ~is_eos.any(-1)
        completion = completion.masked_fill(after_eos, self.tokenizer.pad_token_id)
        texts = self.tokenizer.batch_decode(completion.masked_fill(is_eos, self.tokenizer.pad_token_id),
                                            skip_special_tokens=True)
        return {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"], "completion_ids": completion,
                "completion_mask": mask, "truncated": truncated, "texts": texts}

    def _static_cache(self, model: torch.nn.Module, batch: int, length: int) -> dict:
        """The ``generate`` kwarg holding a fixed-size KV cache for ``batch`` rows of up to ``length`` tokens.

        One cache object is kept and ``reset()`` (zeroed in place) between calls, so its tensors keep their
        addresses: transformers marks them static for the compiled decoding step, and CUDA graphs replay
        only while those addresses stay put (a fresh cache per call, transformers' own
        ``cache_implementation="static"``, re-records the graphs every batch). One cache per batch size
        (and model dtype), the two most recently used kept (so held-out batches do not evict the training one); a longer
        length replaces that batch size's cache (the longest length seen is kept)."""
        from transformers import StaticCache

        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        key = (batch, next(model.parameters()).dtype)  # a rollout copy in another dtype gets its own
        held = self._held_static_caches.pop(key, None)
        if held is not None and held[0] >= length:
            held[1].reset()
        else:
            length = max(length, held[0]) if held is not None else length
            held = (length, StaticCache(config=lm.config.get_text_config(decoder=True), max_cache_len=length))
        self._held_static_caches[key] = held  # newest last
        while len(self._held_static_caches) > 2:
            self._held_static_caches.pop(next(iter(self._held_static_caches)))
        return {_cache_kwarg(lm): held[1]}

    @torch.no_grad()
    def rollout_model(self) -> torch.nn.Module | None:
        """The module sampling runs on when it is not the trained one (``rollout_dtype``), with the trained
        weights pushed into it (one in-place copy per call; built on first use); None otherwise."""
        if self.rollout_dtype is None:
            return None
        source = unwrap(self.model)
        if self._rollout_copy is None:
            self._rollout_copy = copy.deepcopy(source).to(getattr(torch, self.rollout_dtype)).eval()
            self._rollout_copy.requires_grad_(False)
        else:
            for dst, src in zip(self._rollout_copy.parameters(), source.parameters()):
                dst.copy_(src)
        return self._rollout_copy

    def _engine_generate(self, prompts: list[Any]) -> dict:
        """``generate``'s dict (plus ``rollout_logp``) from the vLLM engine: runs of identical prompts (a
        GRPO group) go once with ``n`` = the run length when all runs are equally long, else one by one."""
        from unialign.text.vllm_engine import VLLMEngine

        enc = self._encode_prompts(prompts)
        ids = [row[m.bool()].tolist() for row, m in zip(enc["input_ids"], enc["attention_mask"])]
        starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
        runs = {b - a for a, b in zip(starts, [*starts[1:], len(ids)])}
        n = runs.pop() if len(runs) == 1 else 1
        distinct = [ids[i] for i in starts] if n > 1 else ids
        if self._engine is None:
            self._engine = VLLMEngine(unwrap(self.model), self.tokenizer, **self.vllm_options)
        elif not self._engine_fresh:
            self._engine.push_weights(unwrap(self.model))
        self._engine_fresh = False
        out = self._engine.generate(distinct, n, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                    top_p=self.top_p, top_k=self.top_k, eos_token_id=self.tokenizer.eos_token_id,
                                    pad_token_id=self.tokenizer.pad_token_id)
        self._engine.sleep()  # its GPU memory goes back to the update; the next call pushes and wakes it
        device = enc["input_ids"].device
        completion, mask = out["completion_ids"].to(device), out["completion_mask"].long().to(device)
        shown = completion.masked_fill((completion == self.tokenizer.eos_token_id) | (mask == 0),
                                       self.tokenizer.pad_token_id)
        return {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"], "completion_ids": completion,
                "completion_mask": mask, "truncated": out["truncated"].to(device), "rollout_logp": out["logp"].to(device),
                "texts": self.tokenizer.batch_decode(shown, skip_special_tokens=True)}

    def _use_static_cache(self, model: torch.nn.Module) -> bool:
        if self.generation_cache == "auto":
            return next(model.parameters()).device.type == "cuda"
        return self.generation_cache == "static"

    def sample(self, prompts: list[Any], generator: torch.Generator | None = None,
               record_logp: bool = True) -> Trajectory:
        """One sampled completion per prompt (repeat prompts for groups). ``generator`` is unused:
        ``generate`` draws from torch's global RNG, which the trainer seeds and checkpoints.
        ``record_logp=False`` skips the scoring forward (``old_logp_B_T`` is None). With a rollout copy
        (``rollout_dtype``) the samples come from it and its log-probs go to ``rollout_logp_B_T``."""
        rollout = self.rollout_model()
        if self.generation_backend == "vllm":
            g = self._engine_generate(prompts)
        else:
            g = self.generate(prompts, model=rollout)
        traj = Trajectory(
            prompts=list(prompts),
            completions=g["texts"],
            mask_B_T=g["completion_mask"].float(),
            old_logp_B_T=torch.zeros(0),
            truncated_B=g["truncated"],
            payload={"prompt_ids": g["prompt_ids"], "prompt_mask": g["prompt_mask"],
                     "completion_ids": g["completion_ids"], "completion_mask": g["completion_mask"]},
        )
        if rollout is not None:
            with torch.no_grad():
                rollout_logp, _, _ = self._forward(rollout, traj.payload, False)
            traj.rollout_logp_B_T = rollout_logp.float() * traj.mask_B_T
        elif "rollout_logp" in g:
            traj.rollout_logp_B_T = g["rollout_logp"].float() * traj.mask_B_T
        if not record_logp:
            traj.old_logp_B_T = None
            return traj
        with torch.no_grad():  # the unwrapped module: no DDP collectives while ranks sample independently
            logp, _, _ = self._forward(unwrap(self.model), traj.payload, False)
        traj.old_logp_B_T = logp * traj.mask_B_T
        return traj

    # ---------------------------------------------------------------- log-probs
    def _forward(self, model: torch.nn.Module, payload: dict, with_entropy: bool, with_values: bool = False):
        """Per-token (logp, entropy, values) of ``payload``'s completion tokens, [B, T] each.

        The payload holds a left-padded prompt and a right-padded completion. Batches concatenated
        by ``Trajectory.cat`` get the prompt right-padded too, so prompts are re-aligned to the right
        edge here; position ids follow the attention mask, as in ``generate``.
        """
        prompt_ids, prompt_mask = _right_align(payload["prompt_ids"], payload["prompt_mask"])
        completion = payload["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion], dim=1)
        attention_mask = torch.cat([prompt_mask, payload["completion_mask"]], dim=1)
        T = completion.shape[1]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        # hidden states at positions L-T-1 .. L-1 predict tokens L-T .. L-1 (plus one unused final slot)
        targets = torch.cat([completion, completion[:, :1]], dim=1)
        head = unwrap(model).get_output_embeddings()
        if with_values and self.value_head is None and self.value_model is None:
            raise ValueError("this policy has no critic: build it with value_head=True / 'separate' (PPO)")
        shared = with_values and self.value_head is not None
        prefix = self._prompt_cache(model, prompt_ids, prompt_mask) if self.share_prompt_prefix else None
        with head.targets(targets, self.temperature):
            if prefix is None:
                out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            logits_to_keep=T + 1, output_hidden_states=shared, use_cache=False)
            else:  # only the last prompt token and the completion run per sample, over the shared prompt cache
                out = model(input_ids=input_ids[:, -T - 1:], attention_mask=attention_mask,
                            position_ids=position_ids[:, -T - 1:], output_hidden_states=shared, use_cache=True,
                            **prefix)
        stats = out.logits[:, :-1].float()
        logp, entropy = stats[..., 0], stats[..., 1]
        values = None
        # V(s_t): the state before completion token t, read where that token is predicted
        if shared:
            values = self.value_head(out.hidden_states[-1][:, -T - 1:-1]).squeeze(-1).float()
        elif with_values:
            values = self.value_model(input_ids, attention_mask, position_ids)[:, -T - 1:-1].float()
        return logp, entropy, values

    def _prompt_cache(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """Shared-prefix pass: run each *distinct* prompt (all but its last token) once and return its KV
        cache gathered back to one row per sample, or None when that cannot help or is not safe.

        A GRPO batch holds each prompt G times; the standard pass recomputes the prompt for every
        sample in the forward and the backward. Here the prompt's keys / values are computed for the U
        distinct prompts and indexed out to the B samples (``index_select``, differentiable: gradients
        of all G samples flow back into one prompt pass), so the per-sample pass costs T + 1 tokens
        instead of W + T. Same numbers as the standard pass up to float rounding (tested). Not used
        under a distributed wrapper (two forwards per backward), with gradient checkpointing (no
        cache in training), when no prompt repeats, or when a prompt has fewer than two tokens.
        """
        if model is not unwrap(model) or _fsdp2_root(model) is not None or prompt_ids.shape[1] < 2:
            return None  # FSDP2: the gathered cache's storage is freed on reshard before the backward needs it
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        checkpointing = "is_activation_checkpointing" if hasattr(type(lm), "is_activation_checkpointing") \
            else "is_gradient_checkpointing"  # transformers < 5 name
        if getattr(lm, checkpointing, False):
            return None
        rows = torch.cat([prompt_ids, prompt_mask], dim=1)
        distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
        if distinct.shape[0] == rows.shape[0]:
            return None
        W = prompt_ids.shape[1]
        ids, mask = distinct[:, :W - 1], distinct[:, W:2 * W - 1]
        if bool((mask.sum(-1) < 1).any()):  # an empty prefix would be a fully masked attention row
            return None
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    logits_to_keep=1, use_cache=True)
        key = _cache_kwarg(lm)
        cache = out.get(key)
        if cache is None:
            return None
        cache.reorder_cache(inverse)
        return {key: cache}

    def log_prob(self, trajectory: Trajectory) -> torch.Tensor:
        """Differentiable per-token log-probs of the sampled completion, ``logp_B_T`` (0 where masked)."""
        return self._log_prob(self.model, trajectory, False)

    def log_prob_and_entropy(self, trajectory: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp_B_T, entropy_B_T)`` in one forward (the entropy of the full next-token distribution)."""
        return self._log_prob(self.model, trajectory, True)

    @property
    def has_critic(self) -> bool:
        """Whether this policy carries a value model (``value_head``): the critic protocol of ``unialign.policy``."""
        return self.value_head is not None or self.value_model is not None

    def log_prob_and_values(self, trajectory: Trajectory):
        """(logp_B_T, entropy_B_T, values_B_T): one forward with a shared value head, two with a
        separate critic."""
        logp, entropy, values = self._forward(self.model, trajectory.payload, True, with_values=True)
        mask = trajectory.mask_B_T.to(logp.device)
        return logp * mask, entropy * mask, values * mask

    def preference_batch(self, rows: list[dict[str, Any]], max_length: int | None = None) -> PreferenceBatch:
        """Tokenise normalised pairs (``unialign.text.preference.normalize_pairs``): the prompt with the
        chat template (left-padded), each completion followed by EOS (right-padded, truncated so that
        completions fit in ``max_length`` tokens when given)."""
        from unialign.text.preference import completion_text

        enc = self._encode_prompts([r["prompt"] for r in rows])
        sides = []
        for key in ("chosen", "rejected"):
            texts = [completion_text(r[key]) + self.tokenizer.eos_token for r in rows]
            c = self.tokenizer(texts, return_tensors="pt", padding="longest", add_special_tokens=False,
                               padding_side="right", truncation=max_length is not None, max_length=max_length)
            sides.append({"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
                          "completion_ids": c["input_ids"].to(self.device),
                          "completion_mask": c["attention_mask"].to(self.device)})
        margin = torch.tensor([r["margin"] for r in rows]) if all("margin" in r for r in rows) else None
        return PreferenceBatch(prompts=[r["prompt"] for r in rows], chosen=sides[0], rejected=sides[1],
                               margin_B=margin, chosen_length_B=sides[0]["completion_mask"].sum(-1).float())

    def sequence_log_prob(self, batch: PreferenceBatch, length_normalize: bool = False):
        """Sum (or, with ``length_normalize``, mean) of completion-token log-probs of the chosen and
        rejected sides, [B] each."""
        return _sequence_log_prob(self, self.model, batch, length_normalize)

    # ---------------------------------------------------------------- reference
    def reference(self) -> ReferencePolicy:
        """Adapters disabled when the model is a PEFT model, else a frozen copy made once."""
        base = unwrap(self.model)
        if hasattr(base, "disable_adapter"):
            return ReferencePolicy(self, base, base.disable_adapter)
        if self._frozen_copy is None:
            with _detached_critics(base):  # the reference never needs the critic: do not copy it
                self._frozen_copy = copy.deepcopy(base).eval().requires_grad_(False)
        return ReferencePolicy(self, self._frozen_copy)

    def _log_prob(self, model: torch.nn.Module, trajectory: Trajectory, with_entropy: bool):
        """``log_prob`` / ``log_prob_and_entropy`` on ``model`` (the reference's form)."""
        logp, entropy, _ = self._forward(model, trajectory.payload, with_entropy)
        mask = trajectory.mask_B_T.to(logp.device)
        return (logp * mask, entropy * mask) if with_entropy else logp * mask

    def _sequence_log_prob(self, model: torch.nn.Module, batch: PreferenceBatch, length_normalize: bool):
        return _sequence_log_prob(self, model, batch, length_normalize)

    # ---------------------------------------------------------------- params / io
    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        return [p for p in unwrap(self.model).parameters() if p.requires_grad]

    def save(self, path: str) -> None:
        """``save_pretrained`` of the model (or adapters) and tokenizer, loadable by stock transformers;
        a critic is written beside it (``value_head.safetensors`` / ``value_model.safetensors``), not
        into the model's weights. Called on every process: FSDP2 shards are gathered (a collective), the
        main process writes."""
        from safetensors.torch import save_file

        model = unwrap(self.model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        with _detached_critics(base) as critics:
            state = gathered_state_dict(model) if _fsdp2_root(model) is not None else None
        critic_states = {name: gathered_state_dict(m) for name, m in critics.items()}
        if not is_main_rank():
            return
        with _detached_critics(base):
            model.save_pretrained(path, **({"state_dict": state} if state is not None else {}))
        self.tokenizer.save_pretrained(path)
        for name, sd in critic_states.items():
            save_file({k: v.contiguous() for k, v in sd.items()}, f"{path}/{name}.safetensors")


CRITIC_MODULES = ("value_head", "value_model")


def _cache_kwarg(lm: torch.nn.Module) -> str:
    """The KV-cache argument / output name: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(type(lm).forward).parameters else "past_key_values"


@contextlib.contextmanager
def _detached_critics(base: torch.nn.Module):
    """Temporarily remove the critic submodules from ``base`` (yields them by name)."""
    critics = {name: base._modules.pop(name) for name in CRITIC_MODULES if name in base._modules}
    try:
        yield critics
    finally:
        for name, module in critics.items():
            setattr(base, name, module)


def _zero_linear(hidden: int, device) -> torch.nn.Linear:
    head = torch.nn.Linear(hidden, 1, device=device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head


class ValueModel(torch.nn.Module):
    """A separate PPO critic: a transformer backbone and a scalar head, V [B, L] per position."""

    def __init__(self, body: torch.nn.Module, head: torch.nn.Module):
        super().__init__()
        self.body, self.head = body, head

    @classmethod
    def build(cls, policy_base: torch.nn.Module, source: str) -> ValueModel:
        """``"separate"``: a copy of the policy's backbone with a zero head; else load ``source`` as a
        one-label sequence-classification checkpoint and take its backbone and score head."""
        if source == "separate":  # the decoder holds no critic: those sit on the causal-LM wrapper
            body = copy.deepcopy(policy_base.get_decoder())
            device = next(body.parameters()).device
            return cls(body.requires_grad_(True), _zero_linear(policy_base.config.hidden_size, device))
        from transformers import AutoModelForSequenceClassification

        require_hub(source, "model")
        param = next(policy_base.parameters())
        try:
            seq = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=param.dtype)
        except (OSError, ValueError) as err:
            raise hub_error(source, err) from None
        check_finite(seq, source, "value head")
        if seq.config.vocab_size != policy_base.config.vocab_size:
            raise ValueError(f"value_head={source!r}: its vocabulary ({seq.config.vocab_size}) is not the policy's "
                             f"({policy_base.config.vocab_size}); the critic must read the policy's token ids")
        head = next((getattr(seq, n) for n in ("score", "classifier") if getattr(seq, n, None) is not None), None)
        if head is None:
            raise ValueError(f"value_head={source!r}: no 'score' / 'classifier' head on {type(seq).__name__}")
        return cls(getattr(seq, seq.base_model_prefix), head).to(param.device)

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1)


def _right_align(ids_B_W: torch.Tensor, mask_B_W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Roll each row right so that its last attended token sits in the last column."""
    W = mask_B_W.shape[1]
    last = (mask_B_W * torch.arange(1, W + 1, device=mask_B_W.device)).argmax(-1)  # index of last attended
    shift = (W - 1 - last).unsqueeze(-1)
    if not bool(shift.any()):
        return ids_B_W, mask_B_W
    idx = (torch.arange(W, device=ids_B_W.device) - shift) % W
    return ids_B_W.gather(1, idx), mask_B_W.gather(1, idx)


def _sequence_log_prob(policy: CausalLMPolicy, model, batch: PreferenceBatch, length_normalize: bool):
    """Chosen and rejected run as one 2B batch (one forward, one backward: the prompt encoding is
    shared and the fused head sees twice the rows), completions right-padded to a common length."""
    sides = (batch.chosen, batch.rejected)
    T = max(side["completion_ids"].shape[1] for side in sides)

    def padded(side: dict, key: str) -> torch.Tensor:
        x = side[key]
        return torch.nn.functional.pad(x, (0, T - x.shape[1]))

    joint = {key: torch.cat([side[key] for side in sides]) for key in ("prompt_ids", "prompt_mask")}
    joint.update({key: torch.cat([padded(side, key) for side in sides]) for key in ("completion_ids", "completion_mask")})
    logp, _, _ = policy._forward(model, joint, False)
    mask = joint["completion_mask"].to(logp.dtype)
    total = (logp * mask).sum(-1)
    if length_normalize:
        total = total / mask.sum(-1).clamp(min=1)
    chosen, rejected = total.chunk(2)
    return chosen, rejected
