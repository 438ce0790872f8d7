"""TRL's trainer signature over unialign's trainers: ``GRPOTrainer`` / ``GRPOConfig`` and ``DPOTrainer`` /
``DPOConfig``, for code written the TRL way::

    from datasets import Dataset
    from unialign import GRPOConfig, GRPOTrainer

    def brevity(completions, **kwargs):
        return [-len(c) / 100 for c in completions]

    dataset = Dataset.from_list([{"prompt": "Ann has 12 pens and buys 30 more. How many now?", "answer": "42"}] * 64)
    args = GRPOConfig(output_dir="out", per_device_train_batch_size=16, num_generations=8, max_completion_length=32,
                      max_steps=10, learning_rate=1e-5)
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=["math_accuracy", brevity], args=args,
                          train_dataset=dataset)
    trainer.train()
    trainer.save_model()

They are thin: the config classes are the unialign configs with TRL's keywords accepted (``unialign.trl_compat``:
``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``warmup_ratio``, ``use_peft`` / ``lora_r``, ...,
or a one-line ``UserError`` naming the unialign way), and the trainers build a ``CausalLMPolicy`` and run
``OnlineTrainer`` / ``PreferenceTrainer`` unchanged. ``model``: a Hub id or folder (offline, the shipped arithmetic
model: ``unialign.embedded.ARITH_LM_DIR``), a loaded transformers causal LM (with ``processing_class``, its tokenizer, or the one saved
beside it) or a ``CausalLMPolicy``. Datasets: a ``datasets.Dataset`` or a list of dicts in TRL's formats
(standard or conversational; TRL's rule for the chat template). ``reward_funcs``: a TRL reward function
``f(prompts, completions, **columns)``, a registry name (``"math_accuracy"``) or a list of them. ``train()`` writes
what the scripts write: checkpoints, ``summary.json`` (the held-out mean reward / implicit accuracy before and
after, on ``eval_dataset`` when given), curves, ``final/``; ``state.log_history`` is the per-step history.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from unialign.config import DTYPES, SCHEDULERS, arg, record_origin, resolve_names, validate
from unialign.errors import UserError
from unialign.trainers.online import OnlineConfig
from unialign.trainers.preference import PreferenceConfig


@contextlib.contextmanager
def python_words():
    """The configs' and checks' messages speak of command-line flags (``--learning_rate: must be >= 0``); raised to a
    Python caller they name keywords instead (``learning_rate: must be >= 0``)."""
    try:
        yield
    except UserError as err:
        text = str(err).replace("unknown flag --", "unknown keyword ").replace("; see --help", "")
        raise UserError(re.sub(r"(?<![\w-])--([a-z][a-z0-9_]*)", r"\1", text)) from None


class _TrlKeywords:
    """A config whose constructor takes TRL's keywords too (keywords only, as TRL's configs)."""

    def __init__(self, **kwargs: Any) -> None:
        base = next(c for c in type(self).__mro__[1:] if dataclasses.is_dataclass(c) and not issubclass(c, _TrlKeywords))
        with python_words():
            values = resolve_names(type(self), kwargs)  # UserError for a refused or unknown name
        base.__init__(self, **values)
        self._given = dict(kwargs)  # what the user wrote (num_train_epochs vs max_steps, TRL's precedence)
        record_origin(self, set(values), None)  # the defaults nobody set that differ from TRL's are printed


@dataclass
class _TrlRun:
    """The fields every TRL-style config here shares, at TRL's defaults (put first among the bases: they override
    the loop's own defaults)."""

    lr_scheduler_type: str = arg("linear", "learning-rate schedule after warmup (TRL's linear decay)",
                                 group="optimisation", choices=SCHEDULERS)
    torch_dtype: str = arg("float32", "dtype the weights are loaded in", group="model", choices=DTYPES)
    chat_template: str = arg("auto", "auto (a string prompt raw, a conversation templated), always, never",
                             choices=("auto", "always", "never"))
    gradient_checkpointing: bool = arg(False, "recompute each layer's activations in the backward pass (TRL's "
                                       "default is on; here off: the fused head already avoids the largest tensor)",
                                       group="model")
    trust_remote_code: bool = arg(False, "run modelling code from the model's repository (off unless asked)",
                                  group="model")
    num_train_epochs: float | None = arg(None, "epochs over train_dataset (TRL's name): the trainer sets max_steps to "
                                         "ceil(epochs x rows / the rows of one step: prompts_per_step, or "
                                         "batch_size for pairs and SFT rows) unless max_steps is given too",
                                         group="optimisation", gt=0.0)
    seed: int = arg(42, "seed of sampling, data order and initialisation (TRL's)", group="optimisation")
    output_dir: str = arg("trainer_output", "folder for checkpoints, logs, curves, summary.json and final/")


@dataclass
class _TrlPolicy(_TrlRun):
    """``_TrlRun`` and the knobs of a trained policy's loading (TRL's ``peft_config`` / ``model_init_kwargs``)."""

    lora_rank: int = arg(0, "> 0: train a LoRA of this rank (TRL: peft_config / use_peft)", group="model", min=0)
    attn_implementation: str | None = arg(None, "transformers' attention kernel (unset: the model's default)",
                                          group="model")


@dataclass
class _GRPOFields(_TrlPolicy, OnlineConfig):
    """``OnlineConfig`` plus the generation settings TRL's ``GRPOConfig`` holds (defaults TRL's)."""

    max_completion_length: int | None = arg(512, "generation length in tokens (TRL's name), also the loss "
                                            "normaliser's L and DAPO's limit", min=1)
    beta: float | None = arg(0.0, "KL coefficient to the reference model (TRL's 0.0: no reference model; None: the "
                             "algorithm's, e.g. grpo's published 0.04)", group="algorithm", min=0.0)
    max_prompt_length: int | None = arg(512, "longest prompt in tokens; longer rows are refused (overlong_rows)",
                                        group="data", min=1)
    overlong_rows: str = arg("error", "rows over max_prompt_length: 'error' or 'drop'",
                             group="data", choices=("error", "drop"))
    temperature: float = arg(1.0, "sampling temperature", group="algorithm", gt=0.0)
    top_p: float = arg(1.0, "nucleus sampling mass", group="algorithm", gt=0.0, max=1.0)
    top_k: int = arg(0, "sample among the k most likely tokens (0: all)", group="algorithm", min=0)
    min_p: float = arg(0.0, "min-p sampling: drop tokens below this share of the most likely token's probability "
                       "(0: off)", group="algorithm", min=0.0, lt=1.0)
    repetition_penalty: float = arg(1.0, "penalty on tokens already in the prompt or completion (1: off)",
                                    group="algorithm", gt=0.0)
    learning_rate: float = arg(1e-6, "peak learning rate (TRL's GRPO default)", min=0.0)
    system_prompt: str | None = arg(None, "system message before every templated prompt", group="model")
    generation_backend: str = arg("hf", "rollout engine: hf or vllm (colocated)",
                                  group="model", choices=("hf", "vllm"))
    vllm_gpu_memory_utilization: float = arg(0.3, "vllm: share of the GPU memory the engine takes",
                                             group="model", gt=0.0, max=1.0)
    eval_batch_size: int = arg(64, "prompts per held-out greedy evaluation batch", group="logging", min=1)


class GRPOConfig(_TrlKeywords, _GRPOFields):
    """TRL's ``GRPOConfig`` for ``GRPOTrainer``: every ``OnlineConfig`` field (``algorithm``: grpo, dapo, dr_grpo,
    gspo, rloo, ...; its knobs ``beta``, ``epsilon``, ``loss_type``, ``scale_rewards``, ``num_iterations``, ...),
    the generation settings, and TRL's names (``unialign.trl_compat``)."""

    TRL_CONFIG = "GRPOConfig"  # TRL's defaults; those that differ are printed at start (trl_departures)


@dataclass
class _DPOFields(_TrlPolicy, PreferenceConfig):
    """``PreferenceConfig`` plus what TRL's ``DPOConfig`` holds (defaults TRL's)."""

    beta: float = arg(0.1, "DPO temperature: strength of the implicit KL to the reference",
                      group="algorithm", min=0.0)
    loss_type: str = arg("sigmoid", "DPO loss variant (unialign.algos.preference.DPO_LOSS_TYPES)",
                         group="algorithm")
    label_smoothing: float = arg(0.0, "assumed label-noise rate (cDPO, robust DPO)",
                                 group="algorithm", min=0.0, lt=0.5)
    rpo_alpha: float | None = arg(None, "weight of the chosen side's per-token NLL (RPO)",
                                  group="algorithm", min=0.0)
    max_prompt_length: int | None = arg(512, "longest prompt in tokens; longer pairs are refused",
                                        group="data", min=1)
    max_completion_length: int | None = arg(None, "longest chosen / rejected completion in tokens",
                                            group="algorithm", min=1)
    overlong_rows: str = arg("error", "pairs over a limit: 'error' or 'drop'",
                             group="data", choices=("error", "drop"))
    precompute_ref_log_probs: bool = arg(False, "score every pair with the reference once, up front",
                                         group="algorithm")
    learning_rate: float = arg(1e-6, "peak learning rate (TRL's DPO default)", min=0.0)


class DPOConfig(_TrlKeywords, _DPOFields):
    """TRL's ``DPOConfig`` for ``DPOTrainer``: the pairwise loop's fields, DPO's, and TRL's names."""

    TRL_CONFIG = "DPOConfig"


@dataclass
class _SFTFields(_TrlPolicy, PreferenceConfig):
    """``PreferenceConfig``'s loop plus what TRL's ``SFTConfig`` holds (defaults TRL's)."""

    learning_rate: float = arg(2e-5, "peak learning rate (TRL's SFT default)", min=0.0)


class SFTConfig(_TrlKeywords, _SFTFields):
    """TRL's ``SFTConfig`` for ``SFTTrainer``: the pairwise loop's fields over rows, and TRL's names."""

    TRL_CONFIG = "SFTConfig"


class RLOOConfig(GRPOConfig):
    """TRL's ``RLOOConfig`` for ``RLOOTrainer``: ``GRPOConfig`` with RLOO's leave-one-out baseline
    (``algorithm="rloo"``) and TRL's RLOO defaults (2 generations per prompt, a KL to the reference at beta 0.05, in
    the loss: unialign's RLOO advantage reads sequence rewards, not per-token KL-shaped ones)."""

    TRL_CONFIG = "RLOOConfig"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"algorithm": "rloo", "num_generations": 2, "beta": 0.05, **kwargs})


class AsyncGRPOConfig(GRPOConfig):
    """TRL's ``AsyncGRPOConfig`` for ``AsyncGRPOTrainer``: ``GRPOConfig`` with async rollouts on (``async_rollouts``,
    and ``max_staleness``, TRL's name: how many optimizer steps the sampling weights lag, default 1). TRL samples on a
    vLLM server and sends it the weights; here a thread of this process samples from a copy of the weights
    (docs/scaling.md#async-rollouts), so TRL's server and weight-transfer fields have no counterpart."""

    TRL_CONFIG = "GRPOConfig"  # TRL's AsyncGRPOConfig keeps GRPOConfig's training defaults

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"async_rollouts": True, **kwargs})


class PPOConfig(GRPOConfig):
    """TRL's ``PPOConfig`` for ``PPOTrainer``: ``GRPOConfig`` with PPO's preset (``algorithm="ppo"``: a critic,
    GAE, the KL to the reference in the reward) and one completion per prompt."""

    TRL_CONFIG = None  # TRL's PPO lives in trl.experimental: no stable defaults to list departures from

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"algorithm": "ppo", "num_generations": 1, "beta": None, **kwargs})


@dataclass
class _RewardFields(_TrlRun, PreferenceConfig):
    """``PreferenceConfig``'s loop plus what TRL's ``RewardConfig`` holds (defaults TRL's)."""

    learning_rate: float = arg(1e-4, "peak learning rate (TRL's reward-model default)", min=0.0)
    center_coef: float = arg(0.0, "weight of the reward-centring term (TRL: center_rewards_coefficient)",
                             group="algorithm", min=0.0)
    max_length: int | None = arg(1024, "truncate prompt + completion to this many tokens (TRL's)", group="data",
                                 min=1)


class RewardConfig(_TrlKeywords, _RewardFields):
    """TRL's ``RewardConfig`` for ``RewardTrainer``: the pairwise loop's fields, Bradley-Terry's, TRL's names."""

    TRL_CONFIG = "RewardConfig"


@dataclass
class TrainerState:
    """What TRL's ``trainer.state`` offers that a user reads: the step reached and the per-step history."""

    global_step: int = 0
    log_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float | None
    metrics: dict[str, Any]


def _rows(dataset: Any, name: str) -> list[dict[str, Any]] | None:
    """A ``datasets.Dataset`` (or any iterable of dicts) as a list of row dicts; None stays None."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        raise UserError(f"{name}: a dict of splits was given; pass one split (e.g. dataset['train'])")
    rows = [dict(r) for r in dataset]
    if not rows:
        raise UserError(f"{name}: no rows")
    if not all(isinstance(r, dict) for r in rows):
        raise UserError(f"{name}: rows must be dicts (TRL's standard or conversational format)")
    return rows


def _lora(args: Any, peft_config: Any) -> dict[str, Any]:
    """The LoRA settings of TRL's ``peft_config`` (a ``peft.LoraConfig``) or of ``args.lora_rank``."""
    if peft_config is None:
        return {"lora_rank": args.lora_rank}
    rank = getattr(peft_config, "r", None)
    if not isinstance(rank, int) or rank < 1:
        raise UserError("peft_config: expected a peft.LoraConfig with r >= 1")
    targets = getattr(peft_config, "target_modules", None)
    return {"lora_rank": rank, "lora_alpha": getattr(peft_config, "lora_alpha", None),
            "lora_target_modules": sorted(targets) if isinstance(targets, (set, frozenset)) else targets}


def _policy(model: Any, processing_class: Any, args: Any, peft_config: Any, **kwargs: Any):
    """A ``CausalLMPolicy`` from what TRL's ``model`` argument may be."""
    from unialign.text.policy import CausalLMPolicy

    if isinstance(model, CausalLMPolicy):
        return model
    if isinstance(model, (str, os.PathLike)):  # a vision-language checkpoint gets a VisionLanguagePolicy
        from unialign.recipes.vision import load_policy

        return load_policy(str(model), torch_dtype=args.torch_dtype, **_lora(args, peft_config),
                           gradient_checkpointing=args.gradient_checkpointing,
                           attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code,
                           **kwargs)
    import torch

    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model: expected a Hub id or folder, a transformers model or a CausalLMPolicy, got "
                        f"{type(model).__name__}")
    tokenizer = processing_class
    if tokenizer is None:
        from transformers import AutoTokenizer

        source = getattr(getattr(model, "config", None), "_name_or_path", None)
        if not source:
            raise UserError("processing_class: a loaded model needs its tokenizer (processing_class=tokenizer)")
        tokenizer = AutoTokenizer.from_pretrained(source)
    lora = _lora(args, peft_config)
    if lora["lora_rank"] > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora["lora_rank"], lora_alpha=lora.get("lora_alpha") or
                                                 2 * lora["lora_rank"], task_type="CAUSAL_LM",
                                                 target_modules=lora.get("lora_target_modules") or "all-linear"))
    if hasattr(tokenizer, "image_processor"):  # a processor (TRL's processing_class for a VLM)
        from unialign.vision.policy import VisionLanguagePolicy

        return VisionLanguagePolicy(model, tokenizer, **kwargs)
    return CausalLMPolicy(model, tokenizer, **kwargs)


def _with_images(*splits: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], ...]:
    """TRL's vision rows (``image`` / ``images`` columns) with their images moved into their prompts."""
    from unialign.recipes.vision import has_images
    from unialign.vision.media import vision_rows

    if not has_images([r for rows in splits for r in rows]):
        return splits
    return tuple(vision_rows(rows, name) for rows, name in zip(splits, ("train_dataset", "eval_dataset")))


def _steps_from_epochs(args: Any, rows: int, per_step: int) -> None:
    """TRL's precedence: ``num_train_epochs`` sets ``max_steps`` = ceil(epochs x rows / per_step) unless
    ``max_steps`` was given as well (then it wins); a ``warmup_ratio`` given with it is taken of those steps."""
    given = getattr(args, "_given", {})
    if args.num_train_epochs is None or "max_steps" in given:
        return
    args.max_steps = max(1, math.ceil(args.num_train_epochs * rows / per_step))
    if "warmup_ratio" in given:
        args.warmup_steps = math.ceil(float(given["warmup_ratio"]) * args.max_steps)  # transformers' rounding


def _unsupported(optimizers: Any) -> None:
    if optimizers not in (None, (None, None)):
        raise UserError("optimizers: the optimizer comes from args (optim, learning_rate, weight_decay, "
                        "lr_scheduler_type, warmup_steps)")


TRAIN_SAMPLE = 64  # training rows evaluated before / after when no eval_dataset is given


class _Wrapper:
    """``train()`` / ``evaluate()`` / ``save_model()`` / ``state`` over one of unialign's trainers."""

    def __init__(self, args: Any, default: type, loop_config: type, optimizers: Any = (None, None)):
        """``args`` (``default()`` when None) checked to be a ``loop_config`` and valid, as a Python caller reads it
        (``python_words``); ``optimizers`` refused (they come from ``args``)."""
        args = default() if args is None else args
        if not isinstance(args, loop_config):
            raise UserError(f"args: expected a {default.__name__}, got {type(args).__name__}")
        _unsupported(optimizers)
        with python_words():
            validate(args)
        self.args = args
        self.state = TrainerState()
        self._start = time.time()

    def add_callback(self, callback: Any) -> None:
        """A ``transformers.TrainerCallback`` (object or class), run at TRL's events (``unialign.trainers.callbacks``)."""
        self.trainer.callbacks.add(callback)

    def remove_callback(self, callback: Any) -> None:
        self.trainer.callbacks.remove(callback)

    def pop_callback(self, callback: Any) -> Any:
        return self.trainer.callbacks.remove(callback)

    def _add_callbacks(self, callbacks: Any) -> None:
        for cb in callbacks or ():
            self.add_callback(cb)

    def evaluate(self) -> dict[str, float]:
        """The numbers (``eval/*``) on ``eval_dataset``, or without one on the first training rows
        (``_train_sample``; ``data_info["eval_source"]`` says which)."""
        return self._held_out()

    def _train_sample(self, train: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Without an ``eval_dataset`` the before / after numbers and the completions table come from the first
        ``TRAIN_SAMPLE`` training rows, as TRL logs training completions; ``eval_source`` says they are not held
        out (``summary.json``)."""
        sample = train[:TRAIN_SAMPLE]
        self.data_info["eval_source"] = (f"train_dataset's first {len(sample)} rows (no eval_dataset given): not "
                                         f"held out")
        return sample

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train ``args.max_steps`` steps, then write ``final/`` and ``summary.json`` (the scripts' outputs).
        ``resume_from_checkpoint``: True / "latest" or a checkpoint folder, as ``args.resume_from_checkpoint``."""
        from unialign.trainers import finish_run

        if resume_from_checkpoint:
            raise UserError("resume_from_checkpoint: pass it in the config (GRPOConfig(resume_from_checkpoint="
                            "'latest', ...)): the run directory is checked when the trainer is built")
        before = self._held_out()
        history = self.trainer.train()
        after = self._held_out()
        self.state = TrainerState(self.trainer.step, history)
        losses = [h["loss"] for h in history if isinstance(h.get("loss"), (int, float))]
        summary = {**self._summary(before, after), "steps": self.trainer.step,
                   "wall_seconds": time.time() - self._start, **self.data_info}
        self.summary = finish_run(self.trainer.acc, self.args, summary, self.policy.save,
                                  getattr(self.trainer, "counters", None))
        return TrainOutput(self.trainer.step, sum(losses) / len(losses) if losses else None, after)

    def save_model(self, output_dir: str | None = None) -> None:
        """The weights, stock-loadable (``from_pretrained`` / LoRA adapter), into ``output_dir`` (default
        ``args.output_dir``, as TRL; ``train()`` also wrote them to ``<output_dir>/final``, atomically). The files
        are written into the folder as TRL writes them (it may hold other things: checkpoints); a full disk is one
        line (``DiskFullError``)."""
        from pathlib import Path

        from unialign.files import umask_modes, writing

        target = str(output_dir or self.args.output_dir)
        with writing(None, f"the model in {target}"):
            self.policy.save(target)
        umask_modes(Path(target))

    @property
    def model(self):
        return self.policy.model


class GRPOTrainer(_Wrapper):
    """TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, ...,
    peft_config)`` over ``OnlineTrainer`` (module docstring)."""

    def __init__(self, model: Any, reward_funcs: Any, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), peft_config: Any = None,
                 value_model: Any = None):
        from unialign.recipes.text import as_trl_reward, check_rewards, fit_prompts
        from unialign.rewards import CombinedReward
        from unialign.text.data import prompt_rows
        from unialign.text.evaluate import GreedyHeldOut
        from unialign.text.sampling import SamplingKnobs
        from unialign.trainers.online import OnlineTrainer

        if reward_processing_classes is not None:
            raise UserError("reward_processing_classes: a reward model is a reward function here "
                            "(get_reward('reward_model', path=...)), with its own tokenizer")
        super().__init__(args, GRPOConfig, OnlineConfig, optimizers)
        args = self.args
        train = prompt_rows(_rows(train_dataset, "train_dataset") or [], "train_dataset")
        held = prompt_rows(_rows(eval_dataset, "eval_dataset"), "eval_dataset") if eval_dataset is not None else []
        train, held = _with_images(train, held)
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        columns = {k for r in train[:1] for k in r if k != "prompt"}
        for f in funcs:
            if isinstance(f, str):
                check_rewards(f, None, columns, "reward_funcs")
        reward = CombinedReward(list(funcs), on_error=args.reward_errors)
        critic = value_model if value_model is not None else args.algo_spec().value_coef > 0  # PPO's critic
        self.policy = _policy(model, processing_class, args, peft_config, value_head=critic, sampling=SamplingKnobs(
                                  max_new_tokens=args.max_completion_length, temperature=args.temperature,
                                  top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                  repetition_penalty=args.repetition_penalty),
                              system_prompt=args.system_prompt, chat_template=args.chat_template,
                              generation_backend=args.generation_backend,
                              vllm_options={"gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                                            "seed": args.seed})
        self.policy.max_new_tokens = args.max_completion_length
        self.data_info: dict[str, Any] = {"train_rows": len(train), "eval_rows": len(held)}
        train, held = fit_prompts(self.policy, train, held, args, self.data_info)
        held = held or self._train_sample(train)
        _steps_from_epochs(args, len(train), args.prompts_per_step)
        self.evaluator = (GreedyHeldOut(self.policy, held, {"reward": as_trl_reward(reward)}, args.eval_batch_size)
                          if held else None)
        self.trainer = OnlineTrainer(self.policy, reward, train, args, evaluator=self.evaluator)
        self._add_callbacks(callbacks)

    def _held_out(self) -> dict[str, float]:
        return self.trainer.evaluate() if self.evaluator is not None else {}

    def _summary(self, before: dict, after: dict) -> dict[str, Any]:
        history = self.state.log_history
        return {"metric": "reward", "before": before.get("eval/reward"), "after": after.get("eval/reward"),
                "final_train_reward": next((h["reward/mean"] for h in reversed(history) if "reward/mean" in h), None)}


class DPOTrainer(_Wrapper):
    """TRL's ``DPOTrainer(model, ref_model=None, args, train_dataset, eval_dataset, processing_class, ...,
    peft_config)`` over ``PreferenceTrainer`` with ``DPOObjective``; the reference is the initial model (the
    LoRA base, or a frozen copy), so ``ref_model`` must be None. Rows: TRL's preference formats (``prompt``,
    ``chosen``, ``rejected``; standard or conversational)."""

    def __init__(self, model: Any, ref_model: Any = None, args: DPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, callbacks: Any = None,
                 optimizers: Any = (None, None), peft_config: Any = None):
        from unialign.algos.preference import DPO_LOSS_TYPES
        from unialign.recipes.text import fit_pairs
        from unialign.text.data import prompt_token_counter
        from unialign.text.preference import normalize_pairs
        from unialign.trainers.preference import DPOObjective, PreferenceTrainer

        if ref_model is not None:
            raise UserError("ref_model: the reference is the initial model (a frozen copy, or the LoRA base); "
                            "pass None")
        super().__init__(args, DPOConfig, PreferenceConfig, optimizers)
        args = self.args
        if args.loss_type not in DPO_LOSS_TYPES:
            from unialign.errors import did_you_mean

            raise UserError(f"loss_type: {args.loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}"
                            f"{did_you_mean(args.loss_type, DPO_LOSS_TYPES)}")
        try:
            train = normalize_pairs(_rows(train_dataset, "train_dataset") or [], "train_dataset")
            held = normalize_pairs(_rows(eval_dataset, "eval_dataset"), "eval_dataset") if eval_dataset else []
        except ValueError as err:
            raise UserError(str(err)) from None
        train, held = _with_images(train, held)
        self.policy = _policy(model, processing_class, args, peft_config, chat_template=args.chat_template)
        self.data_info: dict[str, Any] = {"train_rows": len(train), "eval_rows": len(held)}
        train, held = fit_pairs(self.policy.tokenizer, prompt_token_counter(self.policy), train, held, args,
                                self.data_info)
        held = held or self._train_sample(train)
        _steps_from_epochs(args, len(train), args.batch_size)
        self.held = held
        objective = DPOObjective(self.policy, args.beta, args.loss_type, args.label_smoothing,
                                 cache_reference=args.precompute_ref_log_probs, rpo_alpha=args.rpo_alpha)
        self.trainer = PreferenceTrainer(objective, train, args, eval_rows=held or None)
        self._add_callbacks(callbacks)

    def _held_out(self) -> dict[str, float]:
        return {f"eval/{k}": v for k, v in self.trainer.evaluate(self.held).items()} if self.held else {}

    def _summary(self, before: dict, after: dict) -> dict[str, Any]:
        return {"metric": "implicit_accuracy", "before": before.get("eval/implicit_accuracy"),
                "after": after.get("eval/implicit_accuracy")}


class SFTTrainer(_Wrapper):
    """TRL's ``SFTTrainer(model, args, train_dataset, eval_dataset, processing_class, callbacks, ..., peft_config)``
    over ``PreferenceTrainer`` with ``SFTObjective``: the completion's token-mean NLL given the prompt (TRL's
    ``completion_only_loss``; a ``messages`` row trains its last, assistant, turn). Rows: TRL's prompt-completion or
    conversational formats (``unialign.text.sft.sft_rows``). ``model``: a Hub id or folder (a masked-diffusion LM
    folder trains on its ELBO), a loaded transformers model (with ``processing_class``) or a policy."""

    def __init__(self, model: Any, args: SFTConfig | None = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, callbacks: Any = None,
                 optimizers: Any = (None, None), peft_config: Any = None):
        from unialign.text.sft import sft_rows
        from unialign.trainers.preference import PreferenceTrainer, SFTObjective

        if data_collator is not None:
            raise UserError("data_collator: rows are tokenised by the policy (prompt, then completion + EOS)")
        super().__init__(args, SFTConfig, PreferenceConfig, optimizers)
        args = self.args
        train = sft_rows(_rows(train_dataset, "train_dataset") or [], "train_dataset")
        held = sft_rows(_rows(eval_dataset, "eval_dataset"), "eval_dataset") if eval_dataset is not None else []
        self.policy = _sft_policy(model, processing_class, args, peft_config)
        self.data_info: dict[str, Any] = {"train_rows": len(train), "eval_rows": len(held)}
        held = held or self._train_sample(train)
        _steps_from_epochs(args, len(train), args.batch_size)
        self.held = held
        self.trainer = PreferenceTrainer(SFTObjective(self.policy, train), train, args, eval_rows=held)
        self._add_callbacks(callbacks)

    def _held_out(self) -> dict[str, float]:
        return {f"eval/{k}": v for k, v in self.trainer.evaluate(self.held).items()}

    def _summary(self, before: dict, after: dict) -> dict[str, Any]:
        return {"metric": "nll_per_token", "before": before.get("eval/nll_per_token"),
                "after": after.get("eval/nll_per_token")}


def _sft_policy(model: Any, processing_class: Any, args: Any, peft_config: Any):
    """A masked-diffusion LM folder's ``MaskedDiffusionLMPolicy`` (its ELBO estimator), else ``_policy``'s."""
    if isinstance(model, (str, os.PathLike)):
        from unialign.recipes.text import is_masked_diffusion_model

        if is_masked_diffusion_model(str(model)):
            from unialign.dlm.policy import MaskedDiffusionLMPolicy

            return MaskedDiffusionLMPolicy.from_pretrained(str(model), torch_dtype=args.torch_dtype,
                                                           trust_remote_code=args.trust_remote_code,
                                                           estimator="elbo_mc", chat_template=args.chat_template,
                                                           **_lora(args, peft_config))
    return _policy(model, processing_class, args, peft_config, chat_template=args.chat_template)


class RLOOTrainer(GRPOTrainer):
    """TRL's ``RLOOTrainer(model, reward_funcs, args=RLOOConfig(...), train_dataset, ...)``: ``GRPOTrainer`` with
    ``RLOOConfig``'s leave-one-out baseline."""

    def __init__(self, model: Any, reward_funcs: Any, args: RLOOConfig | None = None, **kwargs: Any):
        super().__init__(model, reward_funcs, RLOOConfig() if args is None else args, **kwargs)


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL's ``AsyncGRPOTrainer(model, reward_funcs, args=AsyncGRPOConfig(...), train_dataset, ...)``: ``GRPOTrainer``
    with the next batches sampled while it updates (``AsyncGRPOConfig``)."""

    def __init__(self, model: Any, reward_funcs: Any, args: AsyncGRPOConfig | None = None, **kwargs: Any):
        args = AsyncGRPOConfig() if args is None else args
        if not getattr(args, "async_rollouts", False):
            raise UserError("AsyncGRPOTrainer: args has async_rollouts off; pass AsyncGRPOConfig(...) (or "
                            "async_rollouts=True), or use GRPOTrainer for synchronous sampling")
        super().__init__(model, reward_funcs, args, **kwargs)


class RewardTrainer(_Wrapper):
    """TRL's ``RewardTrainer(model, args, train_dataset, eval_dataset, processing_class, callbacks, ...)`` over
    ``PreferenceTrainer`` with ``BradleyTerryObjective``: a one-label sequence classifier trained on preference
    pairs (TRL's formats), ``summary.json`` the held-out pair accuracy before / after. ``model``: a Hub id or folder
    (a causal LM's gets a new score head), or a loaded ``AutoModelForSequenceClassification`` with
    ``processing_class``."""

    def __init__(self, model: Any, args: RewardConfig | None = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), peft_config: Any = None):
        from unialign.text.preference import normalize_pairs
        from unialign.text.reward_model import RewardModel
        from unialign.trainers.preference import BradleyTerryObjective, PreferenceTrainer

        if data_collator is not None or peft_config is not None:
            raise UserError("data_collator / peft_config: the reward model is trained whole, its pairs tokenised "
                            "by it")
        super().__init__(args, RewardConfig, PreferenceConfig, optimizers)
        args = self.args
        try:
            train = normalize_pairs(_rows(train_dataset, "train_dataset") or [], "train_dataset")
            held = normalize_pairs(_rows(eval_dataset, "eval_dataset"), "eval_dataset") if eval_dataset else []
        except ValueError as err:
            raise UserError(str(err)) from None
        options = dict(max_length=args.max_length, chat_template=args.chat_template)
        if isinstance(model, (str, os.PathLike)):
            self.policy = RewardModel.from_pretrained(str(model), torch_dtype=args.torch_dtype,
                                                      trust_remote_code=args.trust_remote_code,
                                                      gradient_checkpointing=args.gradient_checkpointing, **options)
        elif processing_class is None:
            raise UserError("processing_class: a loaded reward model needs its tokenizer (processing_class=tokenizer)")
        else:
            self.policy = RewardModel(model, processing_class, **options)
        self.data_info: dict[str, Any] = {"train_rows": len(train), "eval_rows": len(held)}
        held = held or self._train_sample(train)  # pairs longer than max_length are truncated when scored
        _steps_from_epochs(args, len(train), args.batch_size)
        self.held = held
        self.trainer = PreferenceTrainer(BradleyTerryObjective(self.policy, args.center_coef), train, args,
                                         eval_rows=held)
        self._add_callbacks(callbacks)

    def _held_out(self) -> dict[str, float]:
        return {f"eval/{k}": v for k, v in self.trainer.evaluate(self.held).items()}

    def _summary(self, before: dict, after: dict) -> dict[str, Any]:
        return {"metric": "accuracy", "before": before.get("eval/accuracy"), "after": after.get("eval/accuracy")}


class PPOTrainer(GRPOTrainer):
    """TRL's ``PPOTrainer(args, processing_class, model, ref_model, reward_model, train_dataset, value_model, ...,
    eval_dataset, callbacks, peft_config)`` over ``OnlineTrainer`` with ``PPOConfig``: ``reward_model`` a
    sequence-classification checkpoint's folder (``get_reward("reward_model", path=...)``) or a TRL reward
    function; ``value_model`` None (a value head on the policy's backbone) or a sequence-classification folder
    whose backbone and score head become the critic, as TRL's; ``ref_model`` None (the reference is the initial
    model)."""

    def __init__(self, args: PPOConfig | None = None, processing_class: Any = None, model: Any = None,
                 ref_model: Any = None, reward_model: Any = None, train_dataset: Any = None, value_model: Any = None,
                 data_collator: Any = None, eval_dataset: Any = None, optimizers: Any = (None, None),
                 callbacks: Any = None, peft_config: Any = None):
        from unialign.rewards import get_reward

        args = PPOConfig() if args is None else args
        if ref_model is not None:
            raise UserError("ref_model: the reference is the initial model (a frozen copy, or the LoRA base); pass "
                            "None")
        if data_collator is not None:
            raise UserError("data_collator: prompts are tokenised by the policy")
        if isinstance(reward_model, (str, os.PathLike)):
            reward = get_reward("reward_model", path=str(reward_model), chat_template=args.chat_template)
        elif callable(reward_model) and not hasattr(reward_model, "parameters"):
            reward = reward_model
        else:
            raise UserError("reward_model: a sequence-classification model's folder (save_pretrained) or a reward "
                            "function f(prompts, completions, **columns)")
        if isinstance(value_model, os.PathLike):
            value_model = str(value_model)
        if value_model is not None and not isinstance(value_model, str):
            raise UserError("value_model: None (a value head on the policy) or a sequence-classification folder")
        super().__init__(model, reward, args, train_dataset, eval_dataset, processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, value_model=value_model)
