"""The argument groups the scripts share, each declared once: a script's config composes the ones it needs and
declares only what is its own (its defaults with ``unialign.config.default``, its own fields with ``arg``).

    RunArgs           --preset (the script's ``PRESETS``) and --config (a YAML file)
    TextRLArgs        the online text scripts' sampling (``TextSamplingArgs``) and --algorithm (text presets)
    TextModelArgs     the text policy: --model_name_or_path, --lora_rank / --lora_alpha / --lora_target_modules,
                      --torch_dtype, --attn_implementation, --gradient_checkpointing, --trust_remote_code
    SystemPromptArgs  --system_prompt
    GenerationCacheArgs  --generation_cache (transformers generate's KV cache)
    TextSamplingArgs  how completions are sampled (``SamplingKnobs``): --max_new_tokens, --temperature, --top_p,
                      --top_k, --min_p, --repetition_penalty, --stop
    RewardArgs        --reward_funcs, --reward_weights
    RolloutEngineArgs --generation_backend, --vllm_gpu_memory_utilization, --rollout_dtype
    DiffusionLMArgs   a masked-diffusion LM's block decoding and log-prob estimator (read only when the model is one:
                      ``unialign.recipes.text.masked_diffusion_policy``)

Put them first among a config's bases (``class C(RunArgs, ..., OnlineConfig)``): a dataclass orders fields from the
last base to the first, so their flags come after the trainer's in each ``--help`` section, the groups listed last
first. The defaults naming the shipped demo worlds are the demo package's (``unialign.embedded.args``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unialign.config import DTYPES, arg
from unialign.registry import algorithms_for
from unialign.text.sampling import SamplingKnobs, parse_stop

ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")  # transformers' names


@dataclass
class RunArgs:
    """Where a run's values come from besides the flags."""

    preset: str | None = arg(None, "named recipe: {presets} (flags still override it)", group="config")
    config: str | None = arg(None, "YAML file of field values (flags override it)", group="config")


@dataclass
class TextModelArgs:
    """The text policy a script loads, with TRL's ``ModelConfig`` knobs (``model_kwargs``: what
    ``CausalLMPolicy.from_pretrained`` / ``VisionLanguagePolicy.from_pretrained`` take)."""

    model_name_or_path: str = arg("", "Hub id or local directory of the model", group="model")
    lora_rank: int = arg(0, "> 0: train a LoRA of this rank instead of the full model", group="model", min=0)
    lora_alpha: float | None = arg(None, "LoRA alpha, the adapter's scale alpha / rank (unset: 2 x --lora_rank)",
                                   group="model", gt=0.0)
    lora_target_modules: str | None = arg(None, "comma-separated module names the LoRA goes on (e.g. q_proj,v_proj), "
                                          "or all-linear (unset: every linear layer; VLMs: the language model's "
                                          "projections)", group="model")
    torch_dtype: str = arg("float32", "model dtype", group="model", choices=DTYPES)
    attn_implementation: str | None = arg(None, "transformers' attention kernel (unset: the model's default, SDPA "
                                          "where it has it)", group="model", choices=ATTENTION)
    gradient_checkpointing: bool = arg(False, "recompute each layer's activations in the backward pass instead of "
                                       "keeping them (less memory, about a third more compute)", group="model")
    trust_remote_code: bool = arg(False, "run modelling code from the model's Hub repository (LLaDA, Dream, "
                                  "DiffuCoder need it); off: such a model is refused", group="model")

    def model_kwargs(self) -> dict[str, Any]:
        """The loading knobs as the policies' ``from_pretrained`` keywords."""
        targets = self.lora_target_modules
        if targets is not None and targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        return dict(lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, lora_target_modules=targets,
                    torch_dtype=self.torch_dtype, attn_implementation=self.attn_implementation,
                    gradient_checkpointing=self.gradient_checkpointing, trust_remote_code=self.trust_remote_code)


@dataclass
class SystemPromptArgs:
    """A system message for chat-template prompts."""

    system_prompt: str | None = arg(None, "system message put before every prompt (chat-template models)",
                                    group="model")


@dataclass
class GenerationCacheArgs:
    """The KV cache of transformers ``generate`` (a causal LM's rollouts)."""

    generation_cache: str = arg("auto", "KV cache: auto (static on CUDA), dynamic, or static (fixed size: CUDA graphs)",
                                group="model", choices=("auto", "dynamic", "static"))


@dataclass
class RolloutEngineArgs:
    """Where rollouts come from: transformers or a colocated vLLM engine, and the rollout copy's dtype."""

    generation_backend: str = arg("hf", "rollout engine: hf (transformers generate) or vllm (colocated; CUDA + pip "
                                  "install 'unialign[vllm]')", group="model", choices=("hf", "vllm"))
    vllm_gpu_memory_utilization: float = arg(0.3, "vllm: share of the GPU memory the engine takes",
                                             group="model", gt=0.0, max=1.0)
    rollout_dtype: str | None = arg(None, "sample from a copy of the policy in this dtype (a rollout/trainer mismatch, "
                                    "corrected by --rollout_correction); unset: sample from the trained model",
                                    group="model", choices=DTYPES)

    def rollout_kwargs(self, seed: int) -> dict:
        """``CausalLMPolicy`` keywords of the rollout engine."""
        return {"rollout_dtype": self.rollout_dtype, "generation_backend": self.generation_backend,
                "vllm_options": {"gpu_memory_utilization": self.vllm_gpu_memory_utilization, "seed": seed}}


@dataclass
class TextSamplingArgs:
    """How a text policy samples: the fields of ``unialign.text.sampling.SamplingKnobs``, one flag each."""

    max_new_tokens: int = arg(64, "completion limit in tokens (sampling and evaluation)", group="algorithm", min=1)
    temperature: float = arg(1.0, "sampling temperature (> 0)", group="algorithm", gt=0.0)
    top_p: float = arg(1.0, "nucleus sampling: keep the smallest token set with this probability mass",
                       group="algorithm", gt=0.0, max=1.0)
    top_k: int = arg(0, "sample among the k most likely tokens (0: all)", group="algorithm", min=0)
    min_p: float = arg(0.0, "min-p sampling: drop tokens below this share of the most likely token's probability "
                       "(0: off)", group="algorithm", min=0.0, lt=1.0)
    repetition_penalty: float = arg(1.0, "CTRL's penalty on tokens already in the prompt or completion (TRL's name; "
                                    "1: off); it shapes what is sampled, the loss scores the model's log-probs",
                                    group="algorithm", gt=0.0)
    stop: str | None = arg(None, "end each completion at this string, as at EOS (kept in its tokens, cut from the text "
                           "the rewards read; sampling and evaluation): one string, \\n and \\t understood, or a "
                           "JSON list of strings", group="algorithm", check=parse_stop)

    def sampling(self) -> SamplingKnobs:
        """The policy's ``sampling`` value."""
        return SamplingKnobs(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                             top_k=self.top_k, min_p=self.min_p, stop=parse_stop(self.stop),
                             repetition_penalty=self.repetition_penalty)


@dataclass
class TextRLArgs(TextSamplingArgs):
    """The online text scripts' sampling and algorithm: ``TextSamplingArgs``, TRL's ``--max_completion_length`` for
    ``--max_new_tokens``, and ``--algorithm`` among the text presets (a script sets its default with ``default``)."""

    ALIASES = {"max_completion_length": "max_new_tokens"}  # TRL's name of the generation length (unialign.trl_compat)
    algorithm: str = arg("grpo", "algorithm preset (its knobs can be overridden one by one)", choices=algorithms_for("text"))


@dataclass
class RewardArgs:
    """The rewards a run optimises."""

    reward_funcs: str = arg("math_accuracy", "comma-separated rewards: registry names, TRL's dotted "
                            "package.module.function, module:function or path/file.py:function", group="algorithm")
    reward_weights: str | None = arg(None, "comma-separated floats, one per reward (default: all 1)", group="algorithm")


@dataclass
class DiffusionLMArgs:
    """A masked-diffusion LM's sampling (``unialign.dlm.DiffusionSampling``, drawn at ``--temperature``; the block's
    length is also the run's ``--max_new_tokens``) and estimator knobs (``unialign.algos.masked_diffusion.EstimatorOptions``); the
    estimator itself is the algorithm's ``--log_prob_estimator``. Read only when the model is a masked-diffusion
    LM."""

    dlm_family: str | None = arg(None, "the masked-diffusion LM family of a Hub model (llada, dream, modernbert: "
                                 "unialign.dlm.families); a local folder's is read from its config.json",
                                 group="model", choices=("llada", "dream", "modernbert"))
    gen_length: int | None = arg(None, "masked-diffusion LM: completion block in tokens (unset: the model's recorded "
                                 "sampling, else its family's)", group="diffusion LM", min=1)
    block_length: int | None = arg(None, "masked-diffusion LM: semi-autoregressive block length (gen_length: one "
                                   "block) (unset: the model's / family's)", group="diffusion LM", min=1)
    diffusion_steps: int | None = arg(None, "masked-diffusion LM: denoising steps over the whole completion (a "
                                      "multiple of its blocks, at most gen_length) (unset: the model's / family's)",
                                      group="diffusion LM", min=1)
    remasking: str | None = arg(None, "masked-diffusion LM: which tokens a step commits (unset: the model's / "
                                "family's)", group="diffusion LM", choices=("low_confidence", "random"))
    confidence_threshold: float | None = arg(None, "masked-diffusion LM: Fast-dLLM parallel decoding, commit every "
                                             "token above this probability (unset: off)", group="diffusion LM",
                                             gt=0.0, max=1.0)
    num_t: int = arg(2, "masked-diffusion LM: masking times of elbo_mc / elbo_quadrature / spg (forwards)",
                     group="diffusion LM", min=1)
    p_mask_prompt: float = arg(0.15, "masked-diffusion LM: one_step's prompt masking probability (d1)",
                               group="diffusion LM", min=0.0, lt=1.0)
    eubo_beta: float = arg(1.5, "masked-diffusion LM: SPG's EUBO power", group="diffusion LM", min=1.0)
    trace_shrink: int = arg(1, "masked-diffusion LM: TraceRL's sampling steps merged per replayed step",
                            group="diffusion LM", min=1)
