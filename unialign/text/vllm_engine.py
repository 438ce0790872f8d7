"""A colocated vLLM rollout engine for ``CausalLMPolicy`` (``--generation_backend vllm``).

vLLM runs in the trainer's own process and GPU (TRL's ``vllm_mode="colocate"``): ``vllm.LLM`` is built
with ``distributed_executor_backend="external_launcher"`` so that its engine and its single worker live
in this process, and the trainer's weights reach it with a plain in-process ``load_weights`` call
(``LLM.apply_model``). Each step:

    engine.generate(distinct_prompt_ids, n)   # rollouts + the engine's own per-token log-probs
    engine.sleep()                            # frees the engine's GPU memory for the update
    ... loss.backward(); optimizer.step() ...
    engine.push_weights(model)                # wakes the weights, loads the new ones

vLLM pins its own torch build, so it is an optional extra (``pip install 'unialign[vllm]'``) and is
only imported when an engine is built. The pure parts (sampling-parameter mapping, output packing,
weight names) are tested on CPU with a stand-in ``LLM``; everything that touches vLLM itself is
checked on a GPU (docs/scaling.md, benchmarks/gpu.sh).

Targets the vLLM releases TRL 1.16 supports (0.22 - 0.31): ``logprobs_mode`` needs >= 0.10.2,
``sleep`` / ``wake_up(tags=...)`` and ``LLM.apply_model`` are in all of them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from unialign.text.sampling import SamplingKnobs

# Modules the policy hangs on its base model that the inference engine knows nothing about
# (``unialign.text.critic.CRITIC_MODULES``; the same names, a test checks).
NOT_IN_ENGINE = ("value_head", "value_model")

# Wrapper segments that distributed / checkpointing wrappers insert into parameter names.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

NO_CUDA = "--generation_backend vllm needs a CUDA GPU; this machine has none: use --generation_backend hf"
NO_VLLM = ("--generation_backend vllm needs the vllm package, which is not installed: "
           "pip install 'unialign[vllm]' (see README for the GPU install line)")


def check_vllm_available() -> None:
    """Raise ``RuntimeError`` with one line when the vLLM backend cannot run here (no CUDA, or no vllm).
    Cheap: looks for the package without importing it (importing vllm takes seconds)."""
    if not torch.cuda.is_available():
        raise RuntimeError(NO_CUDA)
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(NO_VLLM)


def _import_vllm():
    try:
        import vllm
    except Exception as err:  # a broken install (e.g. a torch it was not built for) fails here, not at find_spec
        raise RuntimeError(f"--generation_backend vllm: importing vllm failed ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); pip install 'unialign[vllm]' "
                           "(see README for the GPU install line)") from None
    return vllm


# ----------------------------------------------------------------------------------- sampling parameters
def sampling_kwargs(n: int, knobs: SamplingKnobs, *, greedy: bool, eos_token_id: int) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments matching ``CausalLMPolicy.generate``'s HF ``generate`` call.

    - The knobs: ``SamplingKnobs.vllm_kwargs`` (HF ``top_k=0``, off, is vLLM's ``-1``).
    - ``greedy`` (HF ``do_sample=False``) -> ``temperature=0``, no top-p / top-k, and ``n=1``: vLLM refuses
      ``n > 1`` with greedy decoding, and the ``n`` copies would be identical anyway; ``_pack_outputs``
      repeats the single completion ``n`` times.
    - Stopping: HF stops on exactly ``eos_token_id`` (passed explicitly, overriding the checkpoint's
      ``generation_config``). vLLM would also stop on every ``eos_token_id`` listed in the checkpoint's
      ``generation_config``; ``ignore_eos=True`` switches both of vLLM's own EOS rules off
      (``SamplingParams.update_from_generation_config`` adds the extra ids only when ``ignore_eos`` is
      False; the scheduler's ``check_stop`` tests ``eos_token_id`` only when set, and
      ``stop_token_ids`` always), and ``stop_token_ids=[eos_token_id]`` restores the policy's one.
      The stop token stays in ``CompletionOutput.token_ids`` (the detokenizer re-appends a skipped stop id).
    - ``logprobs=0``: the log-prob of the sampled token only; the engine is built with
      ``logprobs_mode="processed_logprobs"`` so it is the log-prob under the distribution actually sampled
      from (after temperature and top-k / top-p), as TRL's importance-sampling correction uses it.
    - ``detokenize=False``: the engine returns ids; the policy decodes them itself (as on the HF path). No ``stop``
      strings either: vLLM matches them on its own text, and the engine runs without a tokenizer
      (``llm_kwargs``); the policy ends the completions at them itself (``rollout.finish_completions``), as on
      the HF path, so a run with stop strings samples each completion to EOS or ``max_tokens`` here.
    """
    return dict(**knobs.vllm_kwargs(greedy), n=1 if greedy else n, logprobs=0, ignore_eos=True,
                stop_token_ids=[int(eos_token_id)], detokenize=False)


# ----------------------------------------------------------------------------------- output packing
def _sampled_logprob(step: Any, token: int) -> float:
    """The log-prob of ``token`` from one position of ``CompletionOutput.logprobs`` (a ``{id: Logprob}``
    mapping; with ``logprobs=0`` it holds the sampled token only)."""
    entry = step[token]
    return float(getattr(entry, "logprob", entry))


def _pack_outputs(outputs: Sequence[Any], *, n: int, eos_token_id: int, pad_token_id: int, max_new_tokens: int,
                  repeat: int = 1) -> dict[str, torch.Tensor]:
    """vLLM ``RequestOutput``s (one per distinct prompt, in prompt order) -> right-padded tensors.

    Row order is prompt-major: prompt 0's ``n`` completions, then prompt 1's, ... (B = P * n). Each request
    must carry ``n // repeat`` completions; each is used ``repeat`` times (greedy: one completion, repeated).
    Per row, tokens are kept up to and including the first ``eos_token_id``; a row with no EOS within
    ``max_new_tokens`` is truncated.

    Returns ``completion_ids`` long [B, T] (``pad_token_id`` after the kept tokens), ``completion_mask``
    long [B, T] (1 on kept tokens), ``truncated`` bool [B], ``logp`` float32 [B, T] (the engine's log-prob
    of each kept token, 0 on padding). T = the longest kept row.
    """
    if n % repeat:
        raise ValueError(f"n={n} is not a multiple of repeat={repeat}")
    rows: list[tuple[list[int], list[float], bool]] = []
    for p, request in enumerate(outputs):
        completions = list(request.outputs)
        if len(completions) != n // repeat:
            raise ValueError(f"prompt {p}: vLLM returned {len(completions)} completions, expected {n // repeat}")
        for completion in completions:
            ids = [int(t) for t in completion.token_ids][:max_new_tokens]
            cut = ids.index(eos_token_id) + 1 if eos_token_id in ids else len(ids)
            ids = ids[:cut]
            if completion.logprobs is None:
                raise ValueError(f"prompt {p}: vLLM returned no log-probs (SamplingParams.logprobs must be 0)")
            logp = [_sampled_logprob(step, t) for step, t in zip(completion.logprobs, ids)]
            if len(logp) != len(ids):
                raise ValueError(f"prompt {p}: {len(logp)} log-probs for {len(ids)} tokens")
            row = (ids, logp, eos_token_id not in ids)
            rows.extend([row] * repeat)
    width = max((len(ids) for ids, _, _ in rows), default=0)
    B = len(rows)
    completion_ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros(B, width, dtype=torch.long)
    logp_B_T = torch.zeros(B, width, dtype=torch.float32)
    truncated = torch.zeros(B, dtype=torch.bool)
    for b, (ids, logp, trunc) in enumerate(rows):
        k = len(ids)
        completion_ids[b, :k] = torch.tensor(ids, dtype=torch.long)
        completion_mask[b, :k] = 1
        logp_B_T[b, :k] = torch.tensor(logp, dtype=torch.float32)
        truncated[b] = trunc
    return {"completion_ids": completion_ids, "completion_mask": completion_mask, "truncated": truncated,
            "logp": logp_B_T}


# ----------------------------------------------------------------------------------- weights
def _strip_wrappers(model: torch.nn.Module) -> torch.nn.Module:
    """DDP / DeepSpeed wrappers expose ``.module`` and add nothing to gather; FSDP1's wrapper is kept (its
    parameters are gathered through it) and its name segments are stripped in ``_clean_name``."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ in (
            "DistributedDataParallel", "DeepSpeedEngine"):
        model = model.module
    return model


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _clean_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 (DTensor) shard - a collective every rank must join - else ``t``."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def _lora_merged_weight(layer: torch.nn.Module) -> torch.Tensor:
    """``base_layer.weight + sum_a scaling[a] * B_a @ A_a`` (transposed for ``fan_in_fan_out``) over the
    active, not yet merged adapters of a peft LoRA Linear layer, computed in float32 and cast to the base
    weight's dtype. The model is not modified: merging in place and unmerging afterwards (peft's
    ``merge_adapter`` / ``unmerge_adapter``, TRL's route) rounds ``W + d - d`` back into the base weight's
    dtype at every push, a drift of up to one bf16 ulp (~0.4% relative) per optimizer step on a bf16 base."""
    weight = _full(layer.base_layer.weight)
    if getattr(layer, "disable_adapters", False):
        return weight.detach()
    merged = weight.detach().to(torch.float32, copy=True)  # .float() would alias a float32 weight
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A or adapter in getattr(layer, "merged_adapters", ()):
            continue
        if getattr(layer, "use_dora", {}).get(adapter, False) or getattr(layer, "lora_bias", {}).get(adapter, False):
            raise NotImplementedError(f"vLLM weight push: DoRA / lora_bias adapter {adapter!r} is not supported")
        a = _full(layer.lora_A[adapter].weight).detach().float()
        b = _full(layer.lora_B[adapter].weight).detach().float()
        delta = b @ a
        merged = merged + (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]
    return merged.to(weight.dtype)


def vllm_weight_names(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight vLLM's ``model.load_weights`` expects, under the base model's
    Hugging Face checkpoint names (``state_dict`` keys), detached.

    - Plain model: ``named_parameters()`` (tied weights once, as vLLM wants them).
    - peft LoRA model: peft's ``base_model.model.`` prefix and ``.base_layer`` segments stripped, ``lora_*``
      parameters skipped, each LoRA layer's weight yielded merged (``_lora_merged_weight``; the model is
      not modified); ``modules_to_save``: the trained copy under the original name, the original skipped.
    - The policy's critic (``value_head`` / ``value_model``) is skipped: not part of the served model.
    - Wrappers: DDP / DeepSpeed stripped; FSDP1 / activation-checkpointing name segments stripped (FSDP1
      parameters must be gathered by the caller: ``VLLMEngine.push_weights``); FSDP2 ``DTensor`` shards
      are gathered here one tensor at a time (``full_tensor``: every rank must iterate in step).
      DeepSpeed ZeRO-3 partitions are not gathered (TODO: ``deepspeed.zero.GatheredParameters``).
    """
    model = _strip_wrappers(model)
    peft = _is_peft(model)
    lora_prefix = getattr(model, "prefix", "lora_") if peft else None
    lora_layers: dict[str, torch.nn.Module] = {}
    if peft:
        lora_layers = {_clean_name(name): module for name, module in model.named_modules()
                       if hasattr(module, "base_layer") and hasattr(module, "lora_A")}
    adapter = getattr(model, "active_adapter", "default") if peft else None
    for raw_name, param in model.named_parameters():
        name = _clean_name(raw_name)
        if peft:
            if any(part.startswith(lora_prefix) for part in name.split(".")) or ".original_module." in name:
                continue
            owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
            if owner in lora_layers and name.endswith(".base_layer.weight"):
                tensor = _lora_merged_weight(lora_layers[owner])
            else:
                tensor = _full(param).detach()
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            name = name.replace(f".modules_to_save.{adapter}.", ".")
        else:
            tensor = _full(param).detach()
        if name.split(".", 1)[0] in NOT_IN_ENGINE:
            continue
        yield name, tensor


def _gathered(model: torch.nn.Module):
    """FSDP1 keeps flat shards: gather the full parameters for the push (read-only). Other setups: no-op."""
    model = _strip_wrappers(model)
    if type(model).__name__ == "FullyShardedDataParallel":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.summon_full_params(model, writeback=False, recurse=True)
    return contextlib.nullcontext()


def _model_dir_for_engine(model: torch.nn.Module, tokenizer: Any) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """A directory vLLM can build the model from: the model's own local ``name_or_path`` when it is one,
    else a temporary directory holding its config, current (LoRA-merged) weights and tokenizer (local /
    in-memory models have no hub id). The engine's weights are overwritten by a push right after anyway."""
    path = getattr(_strip_wrappers(model), "name_or_path", "") or ""
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return path, None
    from safetensors.torch import save_file

    tmp = tempfile.TemporaryDirectory(prefix="unialign_vllm_")
    base = _strip_wrappers(model)
    base = base.get_base_model() if _is_peft(base) else base
    base.config.save_pretrained(tmp.name)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(tmp.name)
    with _gathered(model):
        save_file({name: t.contiguous().cpu() for name, t in vllm_weight_names(model)},
                  os.path.join(tmp.name, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp.name)
    return tmp.name, tmp


def llm_kwargs(model_dir: str, *, gpu_memory_utilization: float, max_model_len: int | None, dtype: str,
               seed: int, enable_sleep_mode: bool) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for the colocated engine."""
    return dict(
        model=model_dir, trust_remote_code=False, tensor_parallel_size=1,
        # prompts go in as token ids and completions come back as ids (detokenize=False): vLLM needs no
        # tokenizer, and cannot trip over one saved by a newer transformers than its own
        skip_tokenizer_init=True,
        gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, dtype=dtype, seed=seed,
        enable_sleep_mode=enable_sleep_mode,
        # engine and worker in this process (torchrun-style), so weights are loaded by a direct call
        distributed_executor_backend="external_launcher",
        # the log-prob of the distribution sampled from (temperature, top-k / top-p applied), as TRL does
        logprobs_mode="processed_logprobs",
    )


def _set_launcher_env() -> int:
    """``external_launcher`` reads torchrun's variables; fill them in for a plain single process, or
    from the trainer's process group. Returns this process's rank."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return rank


class VLLMEngine:
    """vLLM in the trainer's process (colocate mode): ``generate`` for rollouts, ``push_weights`` after each
    optimizer step, ``sleep`` / ``wake_up`` around the update."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, gpu_memory_utilization: float = 0.3,
                 max_model_len: int | None = None, dtype: str = "auto", seed: int = 0,
                 enable_sleep_mode: bool = True, llm_factory: Callable[..., Any] | None = None,
                 sampling_params_cls: Callable[..., Any] | None = None):
        """``llm_factory(**llm_kwargs(...))`` builds the engine (default ``vllm.LLM``) and
        ``sampling_params_cls(**sampling_kwargs(...))`` its sampling parameters (default
        ``vllm.SamplingParams``): tests pass stand-ins. ``seed`` is offset by the process rank so that
        data-parallel ranks draw different samples. The trainer's current weights are pushed once at
        the end, so a resumed or modified model is served as it is, not as its checkpoint on disk."""
        real_engine = llm_factory is None
        if llm_factory is None or sampling_params_cls is None:
            check_vllm_available()
            vllm = _import_vllm()
            llm_factory = llm_factory or vllm.LLM
            sampling_params_cls = sampling_params_cls or vllm.SamplingParams
        self.enable_sleep_mode = enable_sleep_mode
        self._sampling_params_cls = sampling_params_cls
        self._sleeping: set[str] = set()   # vLLM memory tags now asleep: "weights", "kv_cache"
        self._weights_stale = False         # the engine's weights were discarded (sleep level 2), not re-pushed
        model_dir, self._tmp = _model_dir_for_engine(model, tokenizer)
        rank = _set_launcher_env() if real_engine else 0
        self.llm = llm_factory(**llm_kwargs(model_dir, gpu_memory_utilization=gpu_memory_utilization,
                                            max_model_len=max_model_len, dtype=dtype, seed=seed + rank,
                                            enable_sleep_mode=enable_sleep_mode))
        self.push_weights(model)

    # ------------------------------------------------------------------------------- rollouts
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, knobs: SamplingKnobs, *, greedy: bool = False,
                 eos_token_id: int, pad_token_id: int, seed: int | None = None) -> dict:
        """``n`` completions of each of the P distinct prompts (token ids, no padding), in one engine call
        (``SamplingParams(n=n)``: the prompt is prefilled once per group). Returns ``_pack_outputs``'s
        tensors for the P * n rows, prompt-major (prompt 0's n samples first), on CPU. ``greedy``: one
        completion per prompt, repeated n times; its ``logp`` is whatever vLLM reports for temperature 0
        (evaluation only: not an importance-sampling input). Build the engine after the trainer's process
        group exists: each rank drives its own engine on its own GPU (``LOCAL_RANK``).

        ``seed``: the call draws from per-request seeds instead of the engine's RNG, so what it samples does
        not depend on what the engine ran before (async rollouts: a batch's own seed) -- prompt p gets
        ``seed + p * n``, and vLLM gives its k-th completion ``seed + p * n + k`` (``ParentRequest``'s child
        seeds, vllm/v1/engine/parallel_sampling.py), so no two completions of a call share one."""
        if not prompt_ids:
            raise ValueError("generate: no prompts")
        if self._weights_stale:
            raise RuntimeError("vLLM engine: its weights were discarded by sleep(); call push_weights(model) "
                               "before generating")
        if "kv_cache" in self._sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self._sleeping.discard("kv_cache")
        kwargs = sampling_kwargs(n, knobs, greedy=greedy, eos_token_id=eos_token_id)
        if seed is None:
            params = self._sampling_params_cls(**kwargs)
        else:  # one parameter set per request (LLM.generate takes a list of the prompts' length)
            params = [self._sampling_params_cls(**kwargs, seed=int(seed) + p * n) for p in range(len(prompt_ids))]
        outputs = self.llm.generate([{"prompt_token_ids": [int(t) for t in ids]} for ids in prompt_ids],
                                    sampling_params=params, use_tqdm=False)
        if len(outputs) != len(prompt_ids):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
        return _pack_outputs(outputs, n=n, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                             max_new_tokens=knobs.max_new_tokens, repeat=n if greedy else 1)

    # ------------------------------------------------------------------------------- weights
    @torch.no_grad()
    def push_weights(self, model: torch.nn.Module) -> None:
        """Load the trainer's current weights into the engine (after each optimizer step). LoRA adapters
        are merged on the fly (``vllm_weight_names``); FSDP1 parameters are gathered first, FSDP2 shards
        tensor by tensor, so every rank must call this (each pushes into its own colocated engine).
        Wakes the engine's weight memory first when asleep; the KV cache stays asleep until ``generate``."""
        if "weights" in self._sleeping:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # return the update's freed blocks before vLLM re-maps its pool
            self.llm.wake_up(tags=["weights"])
            self._sleeping.discard("weights")
        with _gathered(model):
            weights = vllm_weight_names(model)
            # apply_model runs the function on the model of each worker: here the single in-process one
            self.llm.apply_model(lambda served: served.load_weights(weights))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self._weights_stale = False

    # ------------------------------------------------------------------------------- memory
    def sleep(self) -> None:
        """Release the engine's GPU memory for the update (no-op without sleep mode).

        Level 2 (as TRL): discard both the weights and the KV cache. Level 1 would first copy the weights
        to CPU RAM and copy them back on wake-up, which is wasted work here: the weights are overwritten by
        ``push_weights`` right after every update (vLLM's docs name level 2 for "RLHF weight update").
        Until that push, ``generate`` refuses to run on the discarded weights."""
        if not self.enable_sleep_mode or self._sleeping:
            return
        self.llm.sleep(level=2)
        self._sleeping = {"weights", "kv_cache"}
        self._weights_stale = True

    def wake_up(self) -> None:
        """Re-allocate whatever is asleep (no-op without sleep mode). After ``sleep`` the weights are
        garbage until ``push_weights``: prefer calling that, which wakes them itself."""
        if not self.enable_sleep_mode or not self._sleeping:
            return
        for tag in ("weights", "kv_cache"):  # weights first: the documented order, and the smaller peak
            if tag in self._sleeping:
                self.llm.wake_up(tags=[tag])
                self._sleeping.discard(tag)
