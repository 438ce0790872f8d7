"""``CausalLMPolicy``: a transformers causal LM behind the ``Policy`` protocol.

A step is a generated token. ``sample`` runs ``generate`` (left padding, EOS handling,
temperature / top-p / top-k) and records the completion mask, truncation flags and the
log-probs of the sampled tokens; ``log_prob`` recomputes them differentiably through the fused
head (no [B, T, V] logits). Sampling-time log-probs are computed by the same module and kernel
as training log-probs, so the first on-policy ratio is 1 up to batching noise (TRL #4159 is
what happens otherwise).

The policy is the contract; its parts are
``prompts.PromptEncoder`` (chat template, system prompt, left-padded ids),
``rollout`` (where samples come from: transformers ``generate``, a low-precision copy, or vLLM),
``critic`` (PPO's value model) and ``prefix`` (each distinct prompt run once).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch

from unialign.dist import fsdp2_root, gathered_state_dict, is_main_rank, unwrap
from unialign.hub import hub_error, require_hub
from unialign.policy import Critic, PolicyBase, ReferencePolicy, SamplingCopy
from unialign.text import prefix
from unialign.text.critic import CRITIC_MODULES, ValueModel, attach_critic, detached_critics
from unialign.text.head import install_fused_head
from unialign.text.prompts import CHAT_TEMPLATE_MODES, PromptEncoder, messages_text, templated
from unialign.text.rollout import HFRollout, LowPrecisionRollout, RolloutEngine, VLLMRollout, build_rollout
from unialign.text.sampling import SamplingKnobs
from unialign.types import PreferenceBatch, Trajectory, _concat
from unialign.weights import check_finite

# Names other modules import from here, from before the parts had modules of their own.
__all__ = ["CHAT_TEMPLATE_MODES", "CRITIC_MODULES", "CausalLMPolicy", "ValueModel", "hub_error",
           "messages_text", "templated", "unwrap"]
_right_align, _cache_kwarg, _detached_critics = prefix.right_align, prefix.cache_kwarg, detached_critics


class _PromptSetting:
    """A policy attribute kept on its ``PromptEncoder`` (read and written there), so that a change made on the
    policy (``policy.chat_template = "never"``) is the one prompts are encoded with."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, policy: Any, owner: type | None = None) -> Any:
        return self if policy is None else getattr(policy.prompt_encoder, self.name)

    def __set__(self, policy: Any, value: Any) -> None:
        setattr(policy.prompt_encoder, self.name, value)


class _SamplingKnob:
    """``policy.<knob>``: that field of ``policy.sampling``; set, a checked copy replaces it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.sampling, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.sampling = obj.sampling.with_(**{self.name: value})


class CausalLMPolicy(PolicyBase, Critic, SamplingCopy):
    """Policy over token sequences. ``model`` may be wrapped (DDP / FSDP) by the trainer."""

    tokenizer = _PromptSetting()
    chat_template = _PromptSetting()
    system_prompt = _PromptSetting()
    max_prompt_length = _PromptSetting()
    max_new_tokens = _SamplingKnob()
    temperature = _SamplingKnob()
    top_p = _SamplingKnob()
    top_k = _SamplingKnob()
    min_p = _SamplingKnob()

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
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
        sampling: SamplingKnobs | None = None,
    ):
        """``sampling`` (``unialign.text.sampling.SamplingKnobs``: max_new_tokens 64, temperature 1, top-p / top-k /
        min-p off by default): how ``sample`` draws completions, read by every rollout engine; ``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k`` and ``min_p`` given as keywords set those knobs of it (``policy.temperature`` and
        its kin read and set ``policy.sampling``).
        ``value_head`` (PPO's critic, ``unialign.text.critic``): ``False``; ``True`` / ``"shared"``: a
        zero-initialised scalar head on the policy's backbone; ``"separate"``: a critic with its own copy of
        the backbone; any other string: a sequence-classification checkpoint (e.g. the reward model) whose
        backbone and score head become the critic.
        ``chat_template`` (TRL's rule, ``unialign.text.prompts``): ``"auto"``: a string prompt is used raw, a
        list of messages goes through the tokenizer's chat template; ``"always"``: a string too (after
        ``system_prompt``); ``"never"``: no template.
        ``share_prompt_prefix``: compute each distinct prompt once per forward (``_prompt_cache``).
        ``generation_cache`` (``rollout.HFRollout``): ``"dynamic"`` (repeated prompts are prefilled once),
        ``"static"`` (a fixed-size KV cache: CUDA graphs on CUDA) or ``"auto"`` (default): static when the
        model is on CUDA, dynamic elsewhere. Same tokens either way.
        ``rollout_dtype`` (``"bfloat16"`` / ``"float16"``, ``rollout.LowPrecisionRollout``): sample from a
        copy of the policy in that dtype, refreshed before every sampling call, its log-probs of the sampled
        tokens in ``Trajectory.rollout_logp_B_T`` (for ``algos.rollout_correction``). Held-out greedy
        evaluation uses the trained model.
        ``generation_backend``: ``"hf"`` (transformers ``generate``) or ``"vllm"`` (``rollout.VLLMRollout``):
        rollouts from a vLLM engine colocated in this process, options ``vllm_options`` such as
        ``gpu_memory_utilization``, built on the first ``sample``; its log-probs go to ``rollout_logp_B_T``.
        Needs CUDA and vllm: checked here, before anything is built."""
        self.generation_backend, self.vllm_options = generation_backend, dict(vllm_options or {})
        self.rollout_dtype, self.generation_cache = rollout_dtype, generation_cache
        self.share_prompt_prefix = share_prompt_prefix
        # a sampling view's (async rollouts) recorded log-probs are decoding's own (``sample``); the policy's, a forward's
        self.logp_from_decoding = False
        self.hf_rollout = HFRollout()  # ``generate``: held-out evaluation, and sampling on the hf backend
        # what ``sample`` uses; the options are checked here, before anything is built
        self.rollout: RolloutEngine = build_rollout(generation_backend, rollout_dtype, generation_cache,
                                                    self.vllm_options, self.hf_rollout)
        base = _base_model(model)
        self.head = install_fused_head(base, chunk_size)
        self.model = model
        given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        self.sampling = (sampling or SamplingKnobs()).with_(**{k: v for k, v in given.items() if v is not None})
        self.prompt_encoder = PromptEncoder(tokenizer, chat_template, system_prompt, max_prompt_length)
        # shared critic: a head on the policy's last hidden state; separate critic: its own backbone and head
        self.value_head, self.value_model = attach_critic(base, value_head, self.head.weight.device)
        self._frozen_copy: torch.nn.Module | None = None

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, name_or_path: str, lora_rank: int = 0, lora_alpha: float | None = None,
                        lora_target_modules: list[str] | str | None = None, torch_dtype: str = "float32",
                        trust_remote_code: bool = False, attn_implementation: str | None = None,
                        gradient_checkpointing: bool = False, **kwargs) -> CausalLMPolicy:
        """Load a causal LM and tokenizer by hub id or local directory; optional LoRA through peft (``lora_alpha``
        default 2 x rank, ``lora_target_modules`` default every linear layer), transformers' ``attn_implementation``
        and activation checkpointing (``load_model_options`` / ``prepare_model``). Fails at once with a clear
        message when the weights are not reachable (offline)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if kwargs.get("generation_backend") == "vllm":  # before any weights load
            from unialign.text.vllm_engine import check_vllm_available

            check_vllm_available()
        require_hub(name_or_path, "model")
        options = load_model_options(name_or_path, torch_dtype, trust_remote_code, attn_implementation)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, **options)
        except (OSError, ValueError) as err:
            raise hub_error(name_or_path, err) from None
        check_finite(model, name_or_path)  # NaN / inf weights: refused now, by tensor name
        install_fused_head(model, kwargs.get("chunk_size", 1024))
        model = prepare_model(model, lora_rank, lora_alpha, lora_target_modules or "all-linear", gradient_checkpointing)
        return cls(model, tokenizer, **kwargs)

    # ---------------------------------------------------------------- prompts (``prompt_encoder``)
    def is_templated(self, prompt: Any) -> bool:
        """Whether ``prompt`` goes through the chat template (``PromptEncoder.is_templated``)."""
        return self.prompt_encoder.is_templated(prompt)

    def format_prompt(self, prompt: Any) -> str:
        """A string prompt, or a list of chat messages, as the text the model is conditioned on."""
        return self.prompt_encoder.format_prompt(prompt)

    def _encode_prompts(self, prompts: list[Any]) -> dict[str, torch.Tensor]:
        """Left-padded prompt ids and mask [B, W] on the policy's device (``PromptEncoder.encode``). Sampling,
        the training forward (the ids are kept in the trajectory), evaluation and the pair losses all go
        through here."""
        return self.prompt_encoder.encode(prompts, self.device)

    def _generate_inputs(self, enc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``_encode_prompts``' output -> (``generate``'s model inputs, what the trajectory's payload keeps
        besides the four token tensors). Text: the ids and mask as they are, nothing more; a subclass whose
        prompts carry more (``VisionLanguagePolicy``: images) turns it into the model's own inputs here."""
        return enc, {}

    @property
    def device(self) -> torch.device:
        return next(unwrap(self.model).parameters()).device

    # ---------------------------------------------------------------- sampling (``rollout``)
    def generate(self, prompts: list[Any], greedy: bool = False, max_new_tokens: int | None = None,
                 model: torch.nn.Module | None = None) -> dict:
        """Generate completions with transformers; returns ids, masks, truncation flags and decoded texts (no
        log-probs; ``RolloutEngine.generate``). ``model``: another module with the same tokenizer to sample
        from (the rollout copy)."""
        return self.hf_rollout.generate(self, prompts, greedy, max_new_tokens, model=model)

    def rollout_model(self) -> torch.nn.Module | None:
        """The module sampling runs on when it is not the trained one (``rollout_dtype``), with the trained
        weights pushed into it (one in-place copy per call; built on first use); None otherwise."""
        if not isinstance(self.rollout, LowPrecisionRollout):
            return None
        return self.rollout.refresh(unwrap(self.model))

    def sampling_view(self, model: torch.nn.Module) -> CausalLMPolicy:
        """``SamplingCopy``: this policy sampling from ``model`` (a frozen copy of the trained module) with its own
        tokenizer (a fast tokenizer is not safe to call from two threads), KV caches and rollout engine (a
        ``rollout_dtype`` copy refreshed from ``model``); the sampling settings are copied as they are now.
        On vLLM the view drives the one engine (built here, on the calling thread, if it is not yet): ``model``'s
        weights are pushed into it before each call, and it stays awake, sampling while the update runs (its
        ``gpu_memory_utilization`` share is held throughout); the trained policy's own sampling must not run
        meanwhile (the trainer samples only through the view when rollouts are async)."""
        view = copy.copy(self)
        view.model = model
        view.prompt_encoder = copy.deepcopy(self.prompt_encoder)
        view.hf_rollout = HFRollout()
        if self.generation_backend == "vllm":
            from unialign.text.vllm_engine import VLLMEngine

            if self.rollout.engine is None:  # vLLM is built on the main thread, not in the rollout thread
                self.rollout.engine = VLLMEngine(model, self.tokenizer, **self.vllm_options)
                self.rollout.fresh = True
            # not fresh: every call pushes the copy's weights, a resumed batch's older ones included
            view.rollout = VLLMRollout(self.vllm_options, engine=self.rollout.engine, sleep_after=False)
        else:
            view.rollout = build_rollout("hf", self.rollout_dtype, self.generation_cache, {}, view.hf_rollout)
        view._frozen_copy = None
        view.logp_from_decoding = True
        return view

    def sample(self, prompts: list[Any], generator: torch.Generator | None = None,
               record_logp: bool = True) -> Trajectory:
        """One sampled completion per prompt (repeat prompts for groups), drawn from ``generator`` when given (the
        Gumbel-max form of the same distribution, ``SamplingKnobs.seeded_kwargs``; not on vLLM), else from torch's
        global RNG, which the trainer seeds and checkpoints.
        ``record_logp=False`` skips the scoring forward (``old_logp_B_T`` is None). From a rollout copy
        (``rollout_dtype``) or vLLM, the engine's log-probs go to ``rollout_logp_B_T``."""
        # a view sampling from its own generator (async rollouts) keeps the log-probs decoding computed: the
        # behaviour policy's, without a scoring forward (with a global-RNG draw, the synchronous run's forward)
        from_decoding = (record_logp and generator is not None and self.logp_from_decoding
                         and self.rollout is self.hf_rollout and self.sampling.repetition_penalty == 1.0)
        g = self.rollout.generate(self, prompts, generator=generator, **({"record_logp": True} if from_decoding else {}))
        traj = Trajectory(
            prompts=list(prompts),
            completions=g["texts"],
            mask_B_T=g["completion_mask"].float(),
            old_logp_B_T=torch.zeros(0),
            truncated_B=g["truncated"],
            payload={"prompt_ids": g["prompt_ids"], "prompt_mask": g["prompt_mask"],
                     "completion_ids": g["completion_ids"], "completion_mask": g["completion_mask"],
                     **g.get("payload", {})},  # what a subclass's prompts carry besides tokens (images)
        )
        if "rollout_logp" in g:
            traj.rollout_logp_B_T = g["rollout_logp"].float() * traj.mask_B_T
        if not record_logp:
            traj.old_logp_B_T = None
            return traj
        if from_decoding:
            traj.old_logp_B_T = g["decode_logp"].float() * traj.mask_B_T
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
        prompt_ids, prompt_mask = prefix.right_align(payload["prompt_ids"], payload["prompt_mask"])
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
        prompt_cache = None
        if self.share_prompt_prefix:
            prompt_cache = self._prompt_cache(model, prompt_ids, prompt_mask)
        with head.targets(targets, self.temperature):
            if prompt_cache is None:
                out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            logits_to_keep=T + 1, output_hidden_states=shared, use_cache=False)
            else:  # only the last prompt token and the completion run per sample, over the shared cache
                out = model(input_ids=input_ids[:, -T - 1:], attention_mask=attention_mask,
                            position_ids=position_ids[:, -T - 1:], output_hidden_states=shared,
                            use_cache=True, **prompt_cache)
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
        """Each distinct prompt (all but its last token) run once, its KV cache gathered back to one row per
        sample, or None when that cannot help or is not safe (``prefix.shared_prompt_cache``)."""
        return prefix.shared_prompt_cache(model, prompt_ids, prompt_mask)

    def log_prob(self, trajectory: Trajectory) -> torch.Tensor:
        """Differentiable per-token log-probs of the sampled completion, ``logp_B_T`` (0 where masked)."""
        return self._log_prob(self.model, trajectory, False)

    def log_prob_and_entropy(self, trajectory: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp_B_T, entropy_B_T)`` in one forward (the entropy of the full next-token distribution)."""
        return self._log_prob(self.model, trajectory, True)

    @property
    def has_critic(self) -> bool:
        """Whether this policy carries a value model (``value_head``): the critic protocol of
        ``unialign.policy``."""
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

    def completion_log_prob(self, side: dict[str, Any]) -> torch.Tensor:
        """Differentiable per-token log-probs [B, T] of one side of a ``preference_batch`` (its completion given
        its prompt), 0 where the completion is padding: supervised fine-tuning's likelihood."""
        logp, _, _ = self._forward(self.model, side, False)
        return logp * side["completion_mask"].to(logp.dtype)

    # ---------------------------------------------------------------- reference
    def reference(self) -> ReferencePolicy:
        """Adapters disabled when the model is a PEFT model, else a frozen copy made once."""
        base = unwrap(self.model)
        if hasattr(base, "disable_adapter"):
            return ReferencePolicy(self, base, base.disable_adapter)
        if self._frozen_copy is None:
            with detached_critics(base):  # the reference never needs the critic: do not copy it
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
        base = _base_model(model)
        with detached_critics(base) as critics:
            state = gathered_state_dict(model) if fsdp2_root(model) is not None else None
        critic_states = {name: gathered_state_dict(m) for name, m in critics.items()}
        if not is_main_rank():
            return
        with detached_critics(base):
            model.save_pretrained(path, **({"state_dict": state} if state is not None else {}))
        self.tokenizer.save_pretrained(path)
        for name, sd in critic_states.items():
            save_file({k: v.contiguous() for k, v in sd.items()}, f"{path}/{name}.safetensors")


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The causal-LM module inside any DDP-style wrapper and PEFT wrapper."""
    model = unwrap(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _sequence_log_prob(policy: CausalLMPolicy, model, batch: PreferenceBatch, length_normalize: bool):
    """Chosen and rejected run as one 2B batch (one forward, one backward: the prompt encoding is
    shared and the fused head sees twice the rows), completions right-padded to a common length. Every other
    entry of the sides (the prompt's ids and mask, a VLM's media and token-aligned processor outputs) is joined
    by ``unialign.types._concat``."""
    sides = (batch.chosen, batch.rejected)
    T = max(side["completion_ids"].shape[1] for side in sides)
    completion = ("completion_ids", "completion_mask")
    joint = {key: _concat([side[key] for side in sides]) for key in sides[0] if key not in completion}
    joint.update({key: torch.cat([torch.nn.functional.pad(side[key], (0, T - side[key].shape[1])) for side in sides])
                  for key in completion})
    logp, _, _ = policy._forward(model, joint, False)
    mask = joint["completion_mask"].to(logp.dtype)
    total = (logp * mask).sum(-1)
    if length_normalize:
        total = total / mask.sum(-1).clamp(min=1)
    chosen, rejected = total.chunk(2)
    return chosen, rejected


def load_model_options(name_or_path: str, torch_dtype: str = "float32", trust_remote_code: bool = False,
                       attn_implementation: str | None = None) -> dict[str, Any]:
    """transformers ``from_pretrained`` keywords of a text / vision-language policy: the dtype, transformers'
    ``attn_implementation`` when given (eager, sdpa, flash_attention_2, ...), and ``trust_remote_code`` -- off
    unless asked, and then said once, since it runs the repository's Python code on this machine."""
    options: dict[str, Any] = {"dtype": getattr(torch, torch_dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    if trust_remote_code:
        print(f"trust_remote_code: running the modelling code of {name_or_path!r} from its repository (read it "
              f"first)")
    return options


def checkpoint_activations(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing, non-reentrant (TRL's default), under its current name
    (``activation_checkpointing_enable``; ``gradient_checkpointing_enable`` before transformers 5)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def prepare_model(model: torch.nn.Module, lora_rank: int = 0, lora_alpha: float | None = None,
                  target_modules: list[str] | str = "all-linear", gradient_checkpointing: bool = False,
                  task_type: str | None = "CAUSAL_LM") -> torch.nn.Module:
    """Activation checkpointing (transformers' ``gradient_checkpointing_enable``, non-reentrant, as TRL's default:
    each layer's activations recomputed in the backward pass instead of kept) and a peft LoRA of ``lora_rank``
    (alpha ``lora_alpha``, default 2 x rank; ``target_modules`` a list of module names or "all-linear"; peft's
    ``task_type``, None for a model that is no causal LM)."""
    if gradient_checkpointing:
        checkpoint_activations(model)
        if lora_rank > 0:
            model.enable_input_require_grads()  # frozen embeddings: the checkpointed blocks still see a grad input
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha or 2 * lora_rank,
                                                 task_type=task_type, target_modules=target_modules))
    return model
