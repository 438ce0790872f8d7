"""What the text scripts share: their data fields, loading and validating rows and rewards before any
model is loaded, and fitting rows to token limits before any model forward.

``TextDataArgs`` is mixed into a script's config (``class GRPOMathConfig(TextDataArgs, OnlineConfig)``);
``load_prompt_data`` / ``load_pair_data`` give (train rows, held-out rows, info for ``summary.json``);
``fit_prompts`` / ``fit_pairs`` apply ``--max_prompt_length`` / ``--max_completion_length`` with the
model's own tokenizer; ``check_rewards`` / ``build_reward`` resolve ``--reward_funcs``.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unialign.config import UserError, arg
from unialign.data import ENCODING_ERRORS, streamed_train_eval_rows, train_eval_rows


@dataclass
class TextDataArgs:
    """Data fields of the text scripts."""

    dataset_name: str = arg("", "a Hub id, a local .jsonl/.json/.parquet file, a folder of split files (train.jsonl, "
                            "test.jsonl, ...), or a registered name (unialign.text.data.NAMED_DATASETS)", group="data")
    dataset_config: str | None = arg(None, "Hub dataset configuration (GSM8K: 'main')", group="data")
    train_split: str = arg("train", "training split of a folder or Hub dataset", group="data")
    eval_split: str | None = arg(None, "held-out split (default: 'test', else 'validation' of a folder; a single file "
                                 "holds out --eval_fraction)", group="data")
    eval_dataset_name: str | None = arg(None, "a separate held-out dataset (file, folder or Hub id) instead of a split "
                                        "of --dataset_name", group="data")
    eval_fraction: float = arg(0.1, "share of the rows held out for evaluation when the data has no held-out split "
                               "(fixed seed 0)", group="data", gt=0.0, lt=1.0)
    num_eval: int = arg(256, "evaluate on at most this many held-out rows", group="data", min=1)
    max_prompt_length: int | None = arg(512, "longest prompt in tokens (chat template and special tokens included); "
                                        "longer rows are refused", group="data", min=1)
    overlong_rows: str = arg("error", "rows over a token limit: 'error' (refuse, naming them) or 'drop' (skip them, "
                             "counted in the summary)", group="data", choices=("error", "drop"))
    encoding_errors: str = arg("strict", "text that is not valid UTF-8: 'strict' (refuse it, naming file:line) or "
                               "'replace' (read each bad byte as U+FFFD)", group="data", choices=ENCODING_ERRORS)
    chat_template: str = arg("auto", "prompts as TRL treats them: auto (a string prompt raw, a conversation -- a list "
                             "of messages -- through the tokenizer's chat template), always (a string too, as one user "
                             "message), never (no template: a conversation's text raw)", group="data",
                             choices=("auto", "always", "never"))
    streaming: bool = arg(False, "read a Hub dataset with datasets' streaming=True: only the rows the run draws (the "
                          "first steps x rows-per-step of --train_split, in the stream's order, and --num_eval held-out "
                          "rows) are fetched; nothing is downloaded whole", group="data")


def check_generation_backend(backend: str) -> None:
    """``--generation_backend vllm`` on a machine that cannot run it: one line, before data or model load."""
    if backend == "vllm":
        from unialign.text.vllm_engine import check_vllm_available

        try:
            check_vllm_available()
        except RuntimeError as err:
            raise UserError(str(err)) from None


def load_prompt_data(cfg: Any) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(train, held-out, info) prompt rows (``unialign.text.data.prompt_rows``, ``cfg.prompt_column`` read as the
    prompt where a script has one) of ``cfg``'s data fields; rows are validated as they are in the files (errors
    name the file and row), then held out."""
    from functools import partial

    from unialign.text.data import NAMED_DATASETS, load_rows
    from unialign.text.data import prompt_rows as rows_of

    prompt_rows = partial(rows_of, prompt_column=getattr(cfg, "prompt_column", "prompt"))  # --prompt_column first
    name = cfg.dataset_name
    if name in NAMED_DATASETS:
        _no_streaming(cfg)
        train, info = prompt_rows(load_rows(name, "train"), f"{name} [train]"), {"eval_source": f"{name} [test]"}
        if cfg.eval_dataset_name is None:
            held_out = prompt_rows(load_rows(name, "test"), f"{name} [test]")
        else:
            rows = load_rows(cfg.eval_dataset_name, cfg.eval_split or "test", cfg.dataset_config,
                             encoding_errors=getattr(cfg, "encoding_errors", "strict"))
            held_out, info["eval_source"] = prompt_rows(rows, cfg.eval_dataset_name), cfg.eval_dataset_name
    else:
        train, held_out, info = _split(cfg, prompt_rows)
    held_out = held_out[:cfg.num_eval]
    return train, held_out, {**info, "train_rows": len(train), "eval_rows": len(held_out)}


def load_pair_data(cfg: Any) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(train, held-out, info) preference pairs (``normalize_pairs``; errors name the file and row); a name
    in ``unialign.text.data.NAMED_PAIR_DATASETS`` builds its pairs (``pairs(split, n, seed)``)."""
    from unialign.text.data import NAMED_PAIR_DATASETS
    from unialign.text.preference import normalize_pairs

    name = cfg.dataset_name
    if name in NAMED_PAIR_DATASETS:
        _no_streaming(cfg)
        pairs = NAMED_PAIR_DATASETS[name]
        train = normalize_pairs(pairs("train", None, cfg.seed), f"{name} [train]")
        held_out = normalize_pairs(pairs("test", cfg.num_eval, cfg.seed + 1), f"{name} [test]")
        info = {"eval_source": f"{name} [test]"}
    else:
        train, held_out, info = _split(cfg, normalize_pairs)
    held_out = held_out[:cfg.num_eval]
    return train, held_out, {**info, "train_rows": len(train), "eval_rows": len(held_out)}


def load_sft_data(cfg: Any) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(train, held-out, info) SFT rows (``unialign.text.sft.sft_rows``: TRL's prompt-completion or messages
    formats, or GSM8K's) of ``cfg``'s data fields: a built-in data set's own train / test splits, else the held-out
    rules of every script (``--eval_split``, ``--eval_dataset_name``, ``--eval_fraction``)."""
    from unialign.text.data import NAMED_DATASETS, load_rows
    from unialign.text.sft import sft_rows

    name = cfg.dataset_name
    if name in NAMED_DATASETS:
        _no_streaming(cfg)
        train = sft_rows(load_rows(name, "train"), f"{name} [train]")
        held_out, info = sft_rows(load_rows(name, "test"), f"{name} [test]"), {"eval_source": f"{name} [test]"}
    else:
        train, held_out, info = _split(cfg, sft_rows)
    held_out = held_out[:cfg.num_eval]
    return train, held_out, {**info, "train_rows": len(train), "eval_rows": len(held_out)}


def _split(cfg: Any, prepare) -> tuple[list[dict], list[dict], dict[str, Any]]:
    errors = getattr(cfg, "encoding_errors", "strict")
    if getattr(cfg, "streaming", False):
        return streamed_train_eval_rows(
            cfg.dataset_name, train_rows=rows_needed(cfg), eval_rows=cfg.num_eval, config_name=cfg.dataset_config,
            train_split=cfg.train_split, eval_split=cfg.eval_split, eval_name=cfg.eval_dataset_name, prepare=prepare,
            encoding_errors=errors)
    return train_eval_rows(cfg.dataset_name, config_name=cfg.dataset_config, train_split=cfg.train_split,
                           eval_split=cfg.eval_split, eval_name=cfg.eval_dataset_name, eval_fraction=cfg.eval_fraction,
                           prepare=prepare, encoding_errors=errors)


def _no_streaming(cfg: Any) -> None:
    if getattr(cfg, "streaming", False):
        raise UserError(f"--streaming: {cfg.dataset_name!r} is a built-in data set, not a Hub dataset; drop --streaming")


def rows_needed(cfg: Any) -> int:
    """Training rows a run of ``cfg`` draws, each once: ``max_steps`` x the rows of one step -- an online
    config's ``prompts_per_step`` (times ``max_generation_rounds`` when its algorithm samples dynamically,
    DAPO), or a preference config's ``batch_size``. What ``--streaming`` reads."""
    if hasattr(cfg, "prompts_per_step"):
        rounds = cfg.max_generation_rounds if cfg.algo_spec().dynamic_sampling else 1
        return cfg.max_steps * cfg.prompts_per_step * rounds
    return cfg.max_steps * cfg.batch_size


def fit_prompts(policy, train: list[dict], held_out: list[dict], cfg: Any, info: dict) -> tuple[list[dict], list[dict]]:
    """Refuse (or drop, counted in ``info``) rows whose prompt is over ``cfg.max_prompt_length`` tokens."""
    from unialign.text.data import prompt_token_counter

    if getattr(policy, "system_prompt", None):
        raw = next((i for i, r in enumerate(train + held_out) if not policy.is_templated(r["prompt"])), None)
        if raw is not None:
            raise UserError(f"--system_prompt: the prompts are plain strings, used raw as TRL does (row {raw}), so "
                            "the system prompt would reach none of them; pass --chat_template always to send each "
                            "string as a user message after it, or give conversational prompts")
    limits = {"prompt": (cfg.max_prompt_length, prompt_token_counter(policy))}
    return _fit(train, held_out, limits, cfg, info)


def fit_pairs(tokenizer, prompt_counter, train: list[dict], held_out: list[dict], cfg: Any,
              info: dict) -> tuple[list[dict], list[dict]]:
    """Refuse (or drop, counted) pairs over ``cfg.max_prompt_length`` / ``cfg.max_completion_length`` tokens."""
    from unialign.text.data import completion_token_counter

    completion = (cfg.max_completion_length, completion_token_counter(tokenizer))
    limits = {"prompt": (cfg.max_prompt_length, prompt_counter), "chosen": completion, "rejected": completion}
    return _fit(train, held_out, limits, cfg, info)


def _fit(train, held_out, limits, cfg, info):
    from unialign.text.data import limit_rows

    row_ids = info.pop("row_ids", {})  # rows held out of one file: name them as they are in the file
    source = cfg.dataset_name if row_ids else None
    train, dropped_train = limit_rows(train, limits, cfg.overlong_rows, source or "train", row_ids.get("train"))
    held_out, dropped_eval = limit_rows(held_out, limits, cfg.overlong_rows, source or "eval", row_ids.get("eval"))
    if dropped_train or dropped_eval:
        info["overlong_rows_dropped"] = {"train": len(dropped_train), "eval": len(dropped_eval),
                                         "first_train_rows": dropped_train[:10], "first_eval_rows": dropped_eval[:10]}
        print(f"dropped rows over the token limits: {len(dropped_train)} train, {len(dropped_eval)} eval", flush=True)
    return train, held_out


# ------------------------------------------------------------------ rewards
def reward_names(spec: str, weights: str | None, flag: str = "--reward_funcs") -> tuple[list[str], list[float] | None]:
    """Comma-separated reward names and optional weights (``UserError`` naming the flag when they do not match)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise UserError(f"{flag}: give at least one reward name")
    if weights is None:
        return names, None
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise UserError(f"--reward_weights: {weights!r} is not a comma-separated list of numbers") from None
    if len(values) != len(names):
        raise UserError(f"--reward_weights: {len(values)} weights for {len(names)} rewards ({spec})")
    return names, values


def check_rewards(spec: str, weights: str | None, columns: set[str] | None = None, flag: str = "--reward_funcs",
                  modality: str | None = None) -> None:
    """Before any model loads: every name resolves (a registry name, or a function given as TRL's dotted
    ``package.module.function``, ``module:function`` or ``path/file.py:function``, as ``get_reward`` accepts),
    a registered reward scores what this script samples (``modality``: "text", "image" or "video", by
    ``unialign.rewards.registry.REWARD_INPUTS`` and ``takes``; None: any), and a reward function's required keyword arguments
    (and, when it declares ``needs_one_of``, one of those columns) are among the dataset ``columns``."""
    from unialign.errors import did_you_mean
    from unialign.rewards import REWARDS, get_reward
    from unialign.rewards.registry import REWARD_INPUTS, resolve, rewards_for, takes

    names, _ = reward_names(spec, weights, flag)
    for name in names:
        offered = rewards_for(modality) if modality else sorted(REWARDS)
        kind = REWARD_INPUTS.get(name, "any")
        if name in REWARDS and modality and not takes(name, modality):
            scores = " and ".join(f"{k}s" for k in kind.split("|"))
            raise UserError(f"{flag}: {name!r} scores {scores}, and this script samples {modality}; its rewards: "
                            f"{', '.join(offered)}, or your own function")
        if name not in REWARDS and not any(c in name for c in ".:/"):
            raise UserError(f"{flag}: unknown reward {name!r}{did_you_mean(name, offered)}; registered"
                            f"{' ' + modality if modality else ''} rewards: {', '.join(offered)}; or give your own "
                            "function as 'package.module.function', 'module:function' or 'path/file.py:function'")
        try:
            target = resolve(REWARDS[name]) if name in REWARDS else get_reward(name).fn
        except Exception as err:  # noqa: BLE001 - an import of user code can raise anything
            raise UserError(f"{flag}: cannot use reward {name!r}: {type(err).__name__}: {err}") from None
        if inspect.isclass(target):
            from unialign.rewards.registry import required_init_args

            needs = required_init_args(target)
            if needs:
                raise UserError(f"{flag}: reward {name!r} needs {', '.join(needs)}, which a reward name cannot give "
                                "(build it in Python with get_reward(name, ...))")
            continue
        if columns is None:
            continue
        have = f"columns besides the prompt: {sorted(columns)}" if columns else "the rows hold only a prompt"
        one_of = getattr(target, "needs_one_of", ())  # a reference in any one of these columns
        if one_of and not set(one_of) & columns:
            raise UserError(f"{flag}: reward {name!r} needs one of the columns {list(one_of)} (the reference "
                            f"answer), which the dataset does not have ({have}); add one, or pass a reward that "
                            "needs none (e.g. math_format, or your own function)")
        missing = sorted(set(required_columns(target)) - columns)
        if missing:
            raise UserError(f"{flag}: reward {name!r} needs the column(s) {missing}, which the dataset does not "
                            f"have ({have})")


def required_columns(fn: Any) -> list[str]:
    """Keyword arguments ``fn`` needs besides ``prompts`` / ``completions`` (no default), i.e. dataset columns."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in ("prompts", "completions")
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def build_reward(spec: str, weights: str | None, flag: str = "--reward_funcs", timeout_s: float | None = None):
    """The ``CombinedReward`` of comma-separated names / paths and weights; ``timeout_s``: each function's time
    limit per batch (``--reward_timeout``; the trainer passes its own per call, this one serves evaluation)."""
    from unialign.rewards import CombinedReward, get_reward

    names, values = reward_names(spec, weights, flag)
    return CombinedReward([get_reward(n) for n in names], values, timeout_s=timeout_s)


def columns_of(rows: list[dict]) -> set[str]:
    """Column names of prompt rows that reach the rewards (all but ``prompt``)."""
    return {k for r in rows[:1] for k in r if k != "prompt"}


def as_trl_reward(reward):
    """A ``CombinedReward`` as a TRL-signature function (for ``unialign.text.evaluate.greedy_score``); a
    non-finite total (a reward that gave no score) counts as no score."""
    import math

    from unialign.rewards import CombinedReward

    if not isinstance(reward, CombinedReward):
        return reward

    def fn(prompts, completions, **columns):
        return [x if math.isfinite(x) else None for x in reward(prompts, completions, columns).rewards_B.tolist()]

    return fn


def reward_model_folder(cfg: Any, trainer_script: Path) -> Path:
    """The reward model's folder: ``--reward_model_path``, else ``<output_dir>/reward_model/final``, trained there
    first by ``trainer_script`` (scripts/train_reward_model.py: ``--max_steps`` from ``--reward_model_steps``; a
    killed run's checkpoints are resumed) unless it exists. A failed training is a ``UserError`` naming the folder."""
    if cfg.reward_model_path is not None:
        if cfg.reward_model_steps is not None:
            raise UserError("--reward_model_steps: trains the embedded reward model, and --reward_model_path names "
                            "one to use as it is; pass one of them")
        return Path(cfg.reward_model_path)
    out = Path(cfg.output_dir) / "reward_model"
    if (out / "final").exists():
        if cfg.reward_model_steps is not None:
            print(f"reusing the reward model in {out / 'final'} (--reward_model_steps applies to a new one)")
        return out / "final"
    print(f"no reward model in {out}: training the embedded one first", flush=True)
    from unialign.trainers.rundir import list_checkpoints

    resume = ["--resume_from_checkpoint", "latest"] if list_checkpoints(out) else []  # a killed one
    steps = [] if cfg.reward_model_steps is None else ["--max_steps", str(cfg.reward_model_steps)]
    code = subprocess.run([sys.executable, str(trainer_script), "--output_dir", str(out), "--report_to", "none",
                           *steps, *resume]).returncode
    if code:
        raise UserError(f"training the embedded reward model into {out} failed (exit status {code}; its error is "
                        "above); or pass --reward_model_path")
    return out / "final"


def train_greedy_rl(cfg: Any, policy, reward, scorer, metric: str, train_rows: list[dict], eval_rows: list[dict],
                    data_info: dict[str, Any], start: float) -> dict[str, Any]:
    """The online run of ``grpo_math`` / ``grpo_vision``: held-out greedy ``metric`` (``scorer``, a TRL-signature
    reward) before, every ``--eval_steps`` and after ``OnlineTrainer`` optimises ``reward``; then ``final/`` and
    ``summary.json`` (before / after, steps, wall time, held-out size, the data's info, the last training reward).
    Returns the summary."""
    from unialign.recipes.outputs import finish_run
    from unialign.text import evaluate
    from unialign.trainers import OnlineTrainer

    held_out = evaluate.GreedyHeldOut(policy, eval_rows, {metric: scorer}, cfg.eval_batch_size)
    trainer = OnlineTrainer(policy, reward, train_rows, cfg, evaluator=held_out)  # eval/<metric> every eval_steps
    before = trainer.evaluate()[f"eval/{metric}"]
    trainer.acc.print(f"held-out greedy {metric} before: {before:.3f}")
    history = trainer.train()
    after = trainer.evaluate()[f"eval/{metric}"]
    trainer.acc.print(f"held-out greedy {metric} after:  {after:.3f}")
    summary = {"metric": metric, "before": before, "after": after, "steps": trainer.step,
               "wall_seconds": time.time() - start, "num_eval": len(eval_rows), **data_info,
               "final_train_reward": next((h["reward/mean"] for h in reversed(history) if "reward/mean" in h), None)}
    return finish_run(trainer.acc, cfg, summary, policy.save, trainer.counters)


# ------------------------------------------------------------------ pair losses (dpo_text)
PAIR_PARAM_FLAGS = {"gamma": "simpo_gamma"}  # a pair loss's parameter -> its flag (TRL's CPOConfig name)


#: pair algorithms that are DPO (the ``--loss_type`` variant against a reference) on a kind of policy: ``vrpo``
#: (LLaDA 1.5, Zhu et al. 2025, arXiv 2505.19223) is DPO on a masked-diffusion LM's ELBO estimates, the masks
#: shared by the policy and the reference and by the two sides of a pair (``MaskedDiffusionLMPolicy.preference_batch``),
#: its budget ``--num_t`` masked forwards per side
DPO_ALGORITHMS = ("dpo", "vrpo")


def pair_algorithms() -> tuple[str, ...]:
    """``--algorithm`` of the text pair script: dpo (the ``--loss_type`` variant, against a reference), vrpo (dpo on
    a masked-diffusion LM) and every reference-free pair loss."""
    from unialign.algos.preference import REFERENCE_FREE_LOSSES

    return (*DPO_ALGORITHMS, *REFERENCE_FREE_LOSSES)


def _pair_entry(algorithm: str, loss_type: str = "sigmoid"):
    from unialign.algos.pair_losses import get_pair_loss

    return get_pair_loss(loss_type if algorithm in DPO_ALGORITHMS else algorithm)


def pair_defaults(nll_weights: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per ``--algorithm``: ``beta`` and the loss's parameters (SimPO's gamma as ``simpo_gamma``) at the pair
    loss's own defaults (``PairLoss.defaults``), and ``rpo_alpha``, the chosen side's NLL weight, from
    ``nll_weights`` (a script's measured choice) or else the loss's own (``PairLoss.nll_coef``)."""
    out = {}
    for algorithm in pair_algorithms():
        entry = _pair_entry(algorithm)
        values = dict(entry.defaults)
        knobs = {"beta": values["beta"]}
        knobs.update({PAIR_PARAM_FLAGS.get(p, p): values[p] for p in entry.params if p != "label_smoothing"})
        knobs["rpo_alpha"] = nll_weights.get(algorithm, entry.nll_coef)
        out[algorithm] = knobs
    return out


def defaults_help(defaults: dict[str, dict[str, float]], key: str) -> str:
    """``"default: dpo 0.1, simpo 2.0, orpo 0.1"``: a knob's default per algorithm, for its help line."""
    return "default: " + ", ".join(f"{a} {d[key]}" for a, d in defaults.items() if key in d)


def pair_loss(cfg: Any, defaults: dict[str, dict[str, float]]) -> tuple[str, dict, dict]:
    """(registered pair loss, its knobs with the algorithm's ``defaults`` filled in, the loss's own parameters),
    checked before any model loads: a parameter flag of another algorithm's loss, or ``--loss_type`` beside a
    reference-free algorithm, is a ``UserError`` naming the flag."""
    from unialign.algos.pair_losses import check_pair_loss_params

    knobs = {k: v if getattr(cfg, k) is None else getattr(cfg, k) for k, v in defaults[cfg.algorithm].items()}
    for flag in PAIR_PARAM_FLAGS.values():
        if getattr(cfg, flag, None) is not None and flag not in knobs:
            owner = next(a for a, d in defaults.items() if flag in d)
            raise UserError(f"--{flag}: applies to --algorithm {owner}, not {cfg.algorithm}")
    if cfg.algorithm not in DPO_ALGORITHMS and cfg.loss_type != "sigmoid":
        raise UserError(f"--loss_type: chooses the DPO variant of --algorithm dpo, not of {cfg.algorithm}")
    entry = _pair_entry(cfg.algorithm, cfg.loss_type)
    params = {p: knobs[PAIR_PARAM_FLAGS.get(p, p)] for p in entry.params if PAIR_PARAM_FLAGS.get(p, p) in knobs}
    check_pair_loss_params(entry.name, cfg.label_smoothing, **params)
    return entry.name, knobs, params


def train_pair_run(cfg: Any, objective, train: list[dict], held_out: list[dict], data_info: dict[str, Any],
                   start: float, task_score=None, head: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run of ``dpo_text``: the reference's log-probs scored once up front with ``--precompute_ref_log_probs``
    (cached under ``output_dir``), ``PreferenceTrainer`` on ``train`` with the held-out pairs' curve, and the
    summary: ``task_score()`` (a built-in task's greedy accuracy) or else the held-out implicit accuracy before /
    after, the first logged losses, ``head`` (the loss and its knobs) after the metric. Returns the summary."""
    from unialign.recipes.outputs import finish_run
    from unialign.trainers.preference import PreferenceTrainer, fingerprint

    policy = objective.policy
    if cfg.precompute_ref_log_probs:
        key = fingerprint(train, policy.model)
        objective.precompute(train, cfg.eval_batch_size, Path(cfg.output_dir) / f"ref_cache-{key}.safetensors")
    trainer = PreferenceTrainer(objective, train, cfg, eval_rows=held_out)  # --eval_steps: held-out curve
    task_before, implicit_before = task_score and task_score(), trainer.evaluate(held_out)["implicit_accuracy"]
    history = [h for h in trainer.train() if "loss" in h]  # training steps (held-out evaluations are eval/* rows)
    task_after, implicit_after = task_score and task_score(), trainer.evaluate(held_out)["implicit_accuracy"]
    summary = {"metric": "accuracy" if task_score else "implicit_accuracy", **(head or {}),
               "before": task_before if task_score else implicit_before,
               "after": task_after if task_score else implicit_after,
               "implicit_accuracy_before": implicit_before, "implicit_accuracy_after": implicit_after,
               "first_loss": history[0]["loss"] if history else None,
               "first_nll_loss": history[0].get("nll_loss") if history else None, "steps": trainer.step,
               "wall_seconds": time.time() - start, "num_eval_pairs": len(held_out), **data_info}
    return finish_run(trainer.acc, cfg, summary, policy.save)


def train_sft_run(cfg: Any, objective, train: list[dict], held_out: list[dict], data_info: dict[str, Any],
                  start: float, task_score=None) -> dict[str, Any]:
    """The run of ``sft.py``: ``PreferenceTrainer`` on ``objective`` (``SFTObjective``) and the summary: the held-out
    completions' token NLL before / after (``nll_before`` / ``nll_after``; the metric unless ``task_score()``, a
    built-in task's greedy accuracy, is given), the first logged loss. Returns the summary."""
    from unialign.recipes.outputs import finish_run
    from unialign.trainers.preference import PreferenceTrainer

    trainer = PreferenceTrainer(objective, train, cfg, eval_rows=held_out)
    task_before, nll_before = task_score and task_score(), trainer.evaluate(held_out)["nll_per_token"]
    history = [h for h in trainer.train() if "loss" in h]
    task_after, nll_after = task_score and task_score(), trainer.evaluate(held_out)["nll_per_token"]
    summary = {"metric": "accuracy" if task_score else "nll_per_token",
               "before": task_before if task_score else nll_before, "after": task_after if task_score else nll_after,
               "nll_before": nll_before, "nll_after": nll_after, "first_loss": history[0]["loss"] if history else None,
               "steps": trainer.step, "wall_seconds": time.time() - start, "num_eval_rows": len(held_out),
               **data_info}
    return finish_run(trainer.acc, cfg, summary, objective.policy.save)


# ------------------------------------------------------------------ masked-diffusion LMs
def _local_config(name_or_path: str) -> dict[str, Any] | None:
    import json

    config = Path(name_or_path) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else None


def is_masked_diffusion_model(name_or_path: str) -> bool:
    """Whether a local model folder is a masked-diffusion LM (its config.json's ``model_type`` is a family of
    ``unialign.dlm.families``, or names one); a Hub id's family is ``--dlm_family``."""
    from types import SimpleNamespace

    from unialign.dlm.families import is_masked_diffusion

    raw = _local_config(name_or_path)
    return raw is not None and is_masked_diffusion(SimpleNamespace(model_type=raw.get("model_type"),
                                                                   unialign_family=raw.get("unialign_family")))


def check_masked_diffusion_source(cfg: Any) -> None:
    """Before any data or model loads, for a Hub masked-diffusion LM (``--dlm_family``): a remote-code family without
    ``--trust_remote_code`` is refused, and a model the Hub cannot give is named (offline: within seconds)."""
    from unialign.dlm import FAMILIES
    from unialign.dlm.families import require_trust
    from unialign.hub import require_hub

    family = cfg.dlm_family
    if family is None:
        return
    try:
        require_trust(FAMILIES[family], f"--model_name_or_path {cfg.model_name_or_path}", cfg.trust_remote_code)
    except ValueError as err:
        raise UserError(str(err)) from None
    try:
        require_hub(cfg.model_name_or_path, "model")
    except (OSError, RuntimeError) as err:
        raise UserError(str(err)) from None


def masked_diffusion_policy(cfg: Any, name_or_path: str, estimator: str | None = None):
    """The ``MaskedDiffusionLMPolicy`` of ``name_or_path`` from a config with ``DiffusionLMArgs``, or None when the
    model is not a masked-diffusion LM (``cfg.dlm_family`` says it of a Hub id; a local folder's config.json of
    itself). ``estimator``: the algorithm's ``log_prob_estimator`` when it names a masked-diffusion estimator, else
    ``DEFAULT_ESTIMATOR``. The sampling: each flag set, else the model's recorded ``unialign_sampling``
    (config.json), else the family's; an estimator's sampling rule (``ar_order``: left to right) on top. Sets
    ``cfg.max_new_tokens`` to the completion block's length. A remote-code family without ``--trust_remote_code``
    is refused by the loader."""
    from unialign.algos.masked_diffusion import LOG_PROB_ESTIMATORS, EstimatorOptions
    from unialign.dlm import FAMILIES, DiffusionSampling, MaskedDiffusionLMPolicy

    family = cfg.dlm_family
    if family is None and not is_masked_diffusion_model(name_or_path):
        return None  # (a Hub model's source and remote-code rule: check_masked_diffusion_source, run by the scripts)
    estimator = estimator if estimator in LOG_PROB_ESTIMATORS else DEFAULT_ESTIMATOR
    raw = _local_config(name_or_path) or {}
    recorded = FAMILIES[family].sampling if family else {}
    recorded = {**recorded, **raw.get("unialign_sampling", {})}
    flags = dict(gen_length=cfg.gen_length, block_length=cfg.block_length, steps=cfg.diffusion_steps,
                 remasking=cfg.remasking, threshold=cfg.confidence_threshold,
                 temperature=getattr(cfg, "temperature", None))
    sampling = {**recorded, **{k: v for k, v in flags.items() if v is not None}}
    sampling.setdefault("gen_length", cfg.max_new_tokens)
    for name, rule in LOG_PROB_ESTIMATORS[estimator].sampling:
        sampling[name] = sampling[rule] if rule in sampling else int(rule)
    try:
        knobs = DiffusionSampling(**sampling)
        policy = MaskedDiffusionLMPolicy.from_pretrained(
            name_or_path, **cfg.model_kwargs(), sampling=knobs, estimator=estimator,
            system_prompt=getattr(cfg, "system_prompt", None),
            chat_template=cfg.chat_template, estimator_options=EstimatorOptions(
                num_t=cfg.num_t, p_mask_prompt=cfg.p_mask_prompt, eubo_beta=cfg.eubo_beta,
                trace_shrink=cfg.trace_shrink))
    except ValueError as err:
        raise UserError(str(err)) from None
    cfg.max_new_tokens = knobs.gen_length
    return policy


#: a masked-diffusion LM's estimator when the algorithm names none (``grpo`` on it): d1's, cheapest, and on the embedded
#: model it learned where elbo_mc at 2 samples (its heavy-tailed 1/t weights) lost accuracy (docs/dlm.md)
DEFAULT_ESTIMATOR = "one_step"
