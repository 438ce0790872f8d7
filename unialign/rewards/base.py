"""The reward contract: any callable with TRL's signature ``f(prompts, completions, **columns) -> list``,
wrapped by ``RewardFunction`` and summed with weights by ``CombinedReward`` into one ``rewards_B``.

Contract (TRL ``GRPOTrainer`` compatible, huggingface/trl#2644, #4939):

* ``prompts`` and ``completions`` are passed **by keyword** (as TRL does), so ``def f(completions, **kw)``
  works. ``columns`` are the per-sample dataset columns (``answer=[...]``), each a list of length B.
* Only the keywords a function accepts are passed, unless it takes ``**kwargs``, which gets everything.
  A required parameter with no matching column is an error naming the function and the column.
* The function returns B scores; ``None`` means "no score" and becomes NaN. Numbers, bools, a 1-D
  tensor or numpy array are accepted; anything else, or the wrong length, raises ``RewardError`` naming
  the function and the sample (its index and the start of its prompt). So does a function that raises.
  With ``on_error="skip"`` such samples are counted and scored NaN instead (they then train like any
  NaN reward: excluded from baselines, advantage 0).
* Scores are float64 from the function to the advantages: rewards of 1e20 keep their differences
  (float32 squares of them overflow a group's variance to inf, and every advantage would be 0).
* Each call gets its own copy of the batch (``fresh_copy``): a function that edits ``completions``,
  ``prompts`` or a column (appends to the list, rewrites a message dict) changes nothing the next function,
  the retry of a failed batch, or the trainer sees. Lists are new; strings and numbers are immutable;
  conversation messages and other lists / dicts / tuples inside are deep-copied; images, tensors and arrays
  are shared (copying them would cost memory; treat them as read-only).
* ``timeout_s`` (``--reward_timeout``): a call that has not returned after that many seconds is stopped
  (``unialign.rewards.deadline``) and raises ``RewardTimeoutError`` naming the function, the limit and the
  step; with ``on_error="skip"`` its batch is scored NaN and counted as reward errors instead.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import numbers
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from unialign.rewards.deadline import CallTimedOut, abandoned_calls, call_with_deadline
from unialign.rewards.registry import required_init_args, resolve_reward

Tensor = torch.Tensor
logger = logging.getLogger(__name__)

_RESERVED = ("prompts", "completions")
ON_ERROR = ("raise", "skip")
MAX_ABS_REWARD = 1e150  # beyond it, float64 means / variances of a group overflow (1e155^2 > 1.8e308)
# --reward_timeout's default: far above any sane call (a reward model or sandbox on a whole batch) and at the
# 10 minutes after which torch's NCCL watchdog would stop a multi-GPU run anyway, with a far less clear message
DEFAULT_REWARD_TIMEOUT_S = 600.0
MAX_ABANDONED_CALLS = 4  # thread mode (no signals): timed-out calls still running before even "skip" stops


class RewardError(ValueError):
    """A reward function raised, or returned something that is not B numbers; the message names the
    function and, where one is to blame, the sample (index and the start of its prompt)."""


class RewardTypeError(RewardError, TypeError):
    """A ``RewardError`` about the type of what a reward function returned."""


class RewardTimeoutError(RewardError):
    """A reward function did not return within its time limit (``--reward_timeout``)."""


class RewardExit(RuntimeError):
    """A reward function called ``sys.exit`` (raised ``SystemExit``): an error of that function, not the run's end."""


def _no_exit(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)``, with ``SystemExit`` from inside it turned into ``RewardExit`` (a reward that calls
    ``sys.exit(0)`` would otherwise end the run with status 0: no error, no checkpoint, no summary)."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as err:
        raise RewardExit(f"it called sys.exit({err.code!r})") from None


def fresh_copy(values: Sequence[Any]) -> Sequence[Any]:
    """A copy of a batch column (a list or tuple) for one reward call: a new one whose lists / dicts / tuples
    (conversation messages, content parts) are deep copies; strings, numbers, images, tensors and arrays are the
    same objects. A column that is not a list or tuple (a batched tensor) is passed as it is."""
    if not isinstance(values, (list, tuple)):
        return values
    out = [copy.deepcopy(v) if isinstance(v, (list, dict, tuple)) else v for v in values]
    return tuple(out) if isinstance(values, tuple) else out


def _short(value: Any, limit: int = 60) -> str:
    """The start of a prompt for an error message (conversational prompts by their last message)."""
    try:
        text = completion_to_text(value)
    except TypeError:
        text = str(value)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _sample(i: int, prompts: Sequence[Any]) -> str:
    return f"sample {i} (prompt {_short(prompts[i])})" if 0 <= i < len(prompts) else f"sample {i}"


def reward_name(fn: Any) -> str:
    """A readable name for a reward callable: ``name`` / ``__name__`` attribute, else its class name."""
    for attr in ("name", "__name__"):
        value = getattr(fn, attr, None)
        if isinstance(value, str) and value:
            return value
    func = getattr(fn, "func", None)  # functools.partial
    if func is not None:
        return reward_name(func)
    return type(fn).__name__


def completion_to_text(completion: Any) -> str:
    """The text of one completion: a string as is; for a conversational completion (a list of
    ``{"role", "content"}`` messages, TRL's format) the content of the last assistant message (the last
    message when none has a role). Content given as a list of parts keeps the ``"text"`` parts, joined.
    ``None`` gives ``""``; any other type raises ``TypeError``."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        if not messages:
            return ""
        assistant = [m for m in messages if m.get("role") == "assistant"]
        return _content_text((assistant or messages)[-1].get("content"))
    raise TypeError(f"cannot read text from a completion of type {type(completion).__name__}")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # [{"type": "text", "text": ...}, {"type": "image"}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise TypeError(f"cannot read text from message content of type {type(content).__name__}")


def map_with_time_limit(fn: Callable[[Any], Any], items: Sequence[Any], timeout_s: float, default: Any) -> list[Any]:
    """``[fn(x) for x in items]`` where an item that takes longer than ``timeout_s`` seconds, or raises,
    gives ``default`` instead.

    The items run one after another on a daemon worker thread; when one overruns, that worker is abandoned
    (it can never write a result afterwards) and a fresh worker continues with the next item. Limits: a
    thread cannot be killed, so an abandoned worker keeps its CPU until it finishes; and one C-level call
    that holds the GIL (a catastrophic regex, ``int()`` of a huge string) delays even the timeout. Code
    run here must therefore be bounded by design (input caps, linear-time parsing); this budget is the
    second line of defence against Python-level slow paths, not the first.
    """
    n = len(items)
    results = [default] * n
    done = [threading.Event() for _ in range(n)]
    lock = threading.Lock()

    def work(start: int, cancelled: threading.Event) -> None:
        for j in range(start, n):
            if cancelled.is_set():
                return
            try:
                value = fn(items[j])
            except Exception as exc:  # a scorer bug must not kill training: default, and say so
                logger.warning("reward item %d raised %s: %s; scored as %r", j, type(exc).__name__, exc, default)
                value = default
            with lock:
                if cancelled.is_set():
                    return
                results[j] = value
                done[j].set()

    start = 0
    while start < n:
        cancelled = threading.Event()
        threading.Thread(target=work, args=(start, cancelled), daemon=True, name="unialign-reward").start()
        next_start = n
        for j in range(start, n):
            if done[j].wait(timeout_s):
                continue
            with lock:
                if done[j].is_set():  # finished between the wait and the lock
                    continue
                cancelled.set()
            logger.warning("reward item %d exceeded %.3g s; scored as %r", j, timeout_s, default)
            next_start = j + 1
            break
        start = next_start
    return list(results)


def _to_scores(out: Any, name: str, batch_size: int, prompts: Sequence[Any] = (),
               on_error: str = "raise") -> tuple[list[float], list[bool]]:
    """Validate a reward function's return value: B floats (None -> NaN) and a per-sample error flag.
    A wrong shape or a non-number raises ``RewardError`` naming the function and the sample; with
    ``on_error="skip"`` the affected samples are NaN and flagged instead."""
    def fail(err: RewardError, where: int | None) -> tuple[list[float], list[bool]]:
        if on_error == "raise":
            raise err
        logger.warning("%s; scored as NaN (reward_errors=skip)", err)
        return [math.nan] * batch_size, [where is None or j == where for j in range(batch_size)]

    if isinstance(out, Tensor):
        if out.dim() != 1:
            return fail(RewardError(f"reward function {name!r} returned a tensor of shape {tuple(out.shape)}; "
                                    "expected [B]"), None)
        out = out.detach().to("cpu", torch.float64).tolist()
    elif hasattr(out, "tolist") and hasattr(out, "ndim"):  # numpy array
        if out.ndim != 1:
            return fail(RewardError(f"reward function {name!r} returned an array of shape {tuple(out.shape)}; "
                                    "expected [B]"), None)
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        return fail(RewardTypeError(f"reward function {name!r} returned {type(out).__name__}; expected a list of "
                                    "B floats or None"), None)
    if len(out) != batch_size:
        return fail(RewardError(f"reward function {name!r} returned {len(out)} scores for a batch of {batch_size} "
                                "completions"), None)
    scores, errors = [], [False] * batch_size
    for i, x in enumerate(out):
        err = None
        if x is None:
            value = math.nan
        elif isinstance(x, (Tensor, numbers.Real)) and (not isinstance(x, Tensor) or x.numel() == 1):
            try:  # int, float, bool, numpy scalars, one-element tensors
                value, shown = float(x.item() if isinstance(x, Tensor) else x), None
            except OverflowError:  # an int beyond float64
                value, shown = math.nan, f"an integer of {len(str(abs(int(x))))} digits"
            if shown or (math.isfinite(value) and abs(value) > MAX_ABS_REWARD):  # inf / NaN: non-finite, excluded later
                err = RewardError(f"reward function {name!r} returned {shown or f'{value:.3g}'} for "
                                  f"{_sample(i, prompts)}: beyond +-{MAX_ABS_REWARD:g}, where float64 group statistics "
                                  "overflow; rescale it")
        else:
            err = RewardTypeError(f"reward function {name!r} returned {type(x).__name__} for {_sample(i, prompts)}; "
                                  "expected float or None")
        if err is not None:
            if on_error == "raise":
                raise err
            logger.warning("%s; scored as NaN (reward_errors=skip)", err)
            value, errors[i] = math.nan, True
        scores.append(value)
    return scores, errors


@dataclass
class RewardFunction:
    """One reward: ``fn`` with TRL's signature, a ``name`` for logging, a ``weight`` used by
    ``CombinedReward``, and fixed keyword arguments ``kwargs`` passed on every call (they override a
    dataset column of the same name).

    ``rf(prompts, completions, **columns)`` returns ``list[float | None]`` (TRL-compatible, so a
    ``RewardFunction`` can be handed to TRL itself); ``rf.score(prompts, completions, columns)`` returns a
    float32 tensor [B] with NaN for ``None``. Both pass ``fn`` only the keywords it accepts.
    """

    fn: Callable[..., Any]
    name: str | None = None
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"reward must be callable, got {type(self.fn).__name__}")
        self.name = self.name or reward_name(self.fn)
        self.weight = float(self.weight)
        try:
            self._params: list[inspect.Parameter] | None = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):  # some builtins / C callables: pass everything, as TRL does
            self._params = None
        if self._params is not None and not self._takes_var_kw():
            names = {p.name for p in self._params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
            unknown = sorted(set(self.kwargs) - names)
            if unknown:
                raise TypeError(f"reward function {self.name!r} does not take keyword(s) {unknown}")

    @property
    def __name__(self) -> str:  # TRL logs reward functions by ``__name__``
        return self.name

    def _takes_var_kw(self) -> bool:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in self._params or ())

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[Any]:
        """Call ``fn`` with the keywords it accepts; return its raw output (TRL's contract)."""
        args, kwargs = self._bind(prompts, completions, columns)
        return self.fn(*args, **kwargs)

    def _bind(self, prompts: list[Any], completions: list[Any], columns: dict[str, Any]) -> tuple[list, dict]:
        """The positional and keyword arguments ``fn`` takes for this batch (TypeError, naming the function,
        when it needs a column the batch lacks)."""
        available = {"prompts": prompts, "completions": completions, **columns, **self.kwargs}
        if self._params is None:
            return [], available
        args: list[Any] = []
        positional_only = [p for p in self._params if p.kind is inspect.Parameter.POSITIONAL_ONLY]
        if len(positional_only) > 2:
            raise TypeError(f"reward function {self.name!r} has more than two positional-only parameters")
        args = [prompts, completions][: len(positional_only)]
        taken = {p.name for p in positional_only}
        if self._takes_var_kw():
            kwargs = {k: v for k, v in available.items() if k not in _RESERVED[: len(positional_only)]}
        else:
            accepted = {p.name for p in self._params
                        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
            kwargs = {k: v for k, v in available.items() if k in accepted and k not in taken}
        missing = [p.name for p in self._params
                   if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                   and p.default is inspect.Parameter.empty and p.name not in kwargs]
        if missing:
            raise TypeError(f"reward function {self.name!r} needs {missing}, which the batch does not provide "
                            f"(columns: {sorted(columns)})")
        return args, kwargs

    def score(self, prompts: list[Any], completions: list[Any], columns: dict[str, list[Any]] | None = None) -> Tensor:
        """Float64 scores [B] (NaN for ``None``). Raises ``RewardError``, naming this function and the
        sample, if it raises or returns the wrong number of scores or a non-number; ValueError if a
        column's length is not B."""
        return self.score_with_metrics(prompts, completions, columns)[0]

    def score_with_metrics(self, prompts: list[Any], completions: list[Any],
                           columns: dict[str, list[Any]] | None = None) -> tuple[Tensor, dict[str, float]]:
        """``score`` plus the batch-level metrics the function reported: a function may return a list
        subclass with a ``metrics`` dict of floats (e.g. the shape verifier's per-part rates); else {}."""
        scores, metrics, _ = self.score_checked(prompts, completions, columns)
        return scores, metrics

    def score_checked(self, prompts: list[Any], completions: list[Any], columns: dict[str, list[Any]] | None = None,
                      on_error: str = "raise", timeout_s: float | None = None,
                      step: int | None = None) -> tuple[Tensor, dict[str, float], Tensor]:
        """(scores float64 [B], metrics, errors bool [B]). ``on_error="raise"``: an exception inside the
        function, or an unusable return value, raises ``RewardError`` naming the function and the first
        sample to blame (found by scoring the samples one at a time when the batch call raised).
        ``"skip"``: those samples score NaN and are flagged in ``errors``. The function gets a fresh copy of the
        batch (``fresh_copy``) on every call; ``timeout_s`` (None / 0: no limit) bounds each call: an overrun
        raises ``RewardTimeoutError`` naming the function, the limit and ``step``, or (``"skip"``) scores the
        whole batch NaN, every sample flagged."""
        if on_error not in ON_ERROR:
            raise ValueError(f"reward_errors must be 'raise' or 'skip', got {on_error!r}")
        columns = dict(columns or {})
        batch_size = len(completions)
        if len(prompts) != batch_size:
            raise ValueError(f"{len(prompts)} prompts for {batch_size} completions")
        for key, values in columns.items():
            if key in _RESERVED:
                raise ValueError(f"column name {key!r} is reserved")
            if len(values) != batch_size:
                raise ValueError(f"column {key!r} has {len(values)} values for a batch of {batch_size}")
        self._bind(prompts, completions, columns)  # a missing column is a setup error: raised
        try:
            out = self._call(prompts, completions, columns, timeout_s, step)
        except RewardTimeoutError as err:  # stopped: the batch has no scores (retrying it alone would wait again)
            if on_error == "raise":
                raise
            if abandoned_calls() >= MAX_ABANDONED_CALLS:
                raise RewardTimeoutError(f"{err} -- and {abandoned_calls()} timed-out calls still run in background "
                                         "threads, so reward_errors=skip stops here") from None
            logger.warning("%s; its %d samples scored NaN (reward_errors=skip)", err, batch_size)
            return (torch.full((batch_size,), math.nan, dtype=torch.float64), {},
                    torch.ones(batch_size, dtype=torch.bool))
        except Exception as err:  # the user's function failed: name it and the sample, or skip the samples
            return self._score_one_by_one(prompts, completions, columns, on_error, err, timeout_s, step)
        metrics = getattr(out, "metrics", None)
        metrics = {str(k): float(v) for k, v in metrics.items()} if isinstance(metrics, dict) else {}
        scores, errors = _to_scores(out, self.name, batch_size, prompts, on_error)
        return torch.tensor(scores, dtype=torch.float64), metrics, torch.tensor(errors, dtype=torch.bool)

    def _call(self, prompts: list[Any], completions: list[Any], columns: dict[str, list[Any]],
              timeout_s: float | None, step: int | None) -> Any:
        """``fn`` on a fresh copy of the batch (``fresh_copy``), under ``timeout_s`` (``RewardTimeoutError``)."""
        args, kwargs = self._bind(fresh_copy(prompts), fresh_copy(completions),
                                  {k: fresh_copy(v) for k, v in columns.items()})
        try:
            return call_with_deadline(lambda: _no_exit(self.fn, args, kwargs),
                                      timeout_s, f"reward function {self.name!r}")
        except CallTimedOut as err:
            at = f" at step {step}" if step is not None else ""
            how = "abandoned: it still runs in a background thread" if err.abandoned else f"stopped at {err.where}"
            raise RewardTimeoutError(
                f"reward function {self.name!r} did not return within {err.seconds:g} s{at} on a batch of "
                f"{len(completions)} completions ({how}); raise --reward_timeout (0: no limit), or pass "
                "--reward_errors skip to score such batches as reward errors") from None

    def _score_one_by_one(self, prompts, completions, columns, on_error: str, batch_err: Exception,
                          timeout_s: float | None = None, step: int | None = None):
        """After the batch call raised ``batch_err``: score each sample alone to find the ones to blame (each call
        under ``timeout_s``; once one overruns, it and the samples not yet scored are errors)."""
        scores, errors, first = [], [], None
        for i in range(len(completions)):
            one = {k: v[i:i + 1] for k, v in columns.items()}
            try:
                out = self._call(prompts[i:i + 1], completions[i:i + 1], one, timeout_s, step)
                value, bad = _to_scores(out, self.name, 1, prompts[i:i + 1], on_error)
                value, bad = value[0], bad[0]
            except Exception as err:
                if first is None:
                    first = (i, err)
                if on_error == "raise":
                    break
                if isinstance(err, RewardTimeoutError):  # do not wait again for each remaining sample
                    rest = len(completions) - i
                    scores, errors = scores + [math.nan] * rest, errors + [True] * rest
                    break
                value, bad = math.nan, True
            scores.append(value)
            errors.append(bad)
        if on_error == "raise":
            i, err = first if first is not None else (None, batch_err)
            if isinstance(err, RewardError):  # already names the function and the sample
                raise err
            where = _sample(i, prompts) if i is not None else f"a batch of {len(completions)} (no sample fails alone)"
            frames = traceback.extract_tb(err.__traceback__)
            at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
            raise RewardError(f"reward function {self.name!r} raised {type(err).__name__}{at} on {where}: {err} "
                              "(reward_errors='skip' scores such samples NaN and counts them)") from err
        logger.warning("reward function %r raised %s on %d of %d samples (first: %s); scored as NaN",
                       self.name, type(batch_err).__name__, sum(errors), len(errors),
                       _sample(first[0], prompts) if first else "none alone")
        if not any(errors):  # the batch failed but every sample alone works: the batch is to blame
            errors = [True] * len(completions)
            scores = [math.nan] * len(completions)
        return torch.tensor(scores, dtype=torch.float64), {}, torch.tensor(errors, dtype=torch.bool)


def get_reward(name: str, **kwargs: Any) -> RewardFunction:
    """The reward ``name`` as a ``RewardFunction`` (named after the registry entry or the function, weight 1).

    ``name`` is a registered name, TRL's dotted ``package.module.function``, ``module:function`` or
    ``path/to/file.py:function`` (see ``resolve_reward``). A class is instantiated with ``kwargs``; a
    function gets ``kwargs`` bound to every call (a TypeError here if it does not take them). Unknown
    names raise ValueError listing the registered ones.
    """
    target, label = resolve_reward(name)
    if inspect.isclass(target):
        missing = [p for p in required_init_args(target) if p not in kwargs]
        if missing:
            raise ValueError(f"reward {name!r} needs {', '.join(missing)} (e.g. get_reward({name!r}, "
                             f"{missing[0]}=...)); it cannot be built from its name alone")
        return RewardFunction(target(**kwargs), name=label)
    return RewardFunction(target, name=label, kwargs=kwargs)


class ScoreList(list):
    """A list of scores (TRL's return type) that also carries batch-level ``metrics`` (name -> float) for
    logging, e.g. a verifier's fidelity rate; ``RewardFunction.score_with_metrics`` reads them."""

    metrics: dict[str, float]


@dataclass
class RewardOutput:
    """What ``CombinedReward`` returns.

    rewards_B:     float64 [B], sum_i weight_i * score_i. NaN where a component with non-zero weight is
                   not finite (None / NaN / inf) under ``on_nonfinite="nan"``, or failed (``on_error``);
                   see ``CombinedReward``.
    per_function:  name -> float64 [B], each function's raw (unweighted) scores, NaN for None.
    num_nonfinite: how many of the B entries of ``rewards_B`` are not finite.
    num_errors:    samples whose score a function failed to give (raised / not a number; ``on_error="skip"``),
                   counted once per sample; ``errors_per_function``: the same per function name.
    function_metrics: ``"<name>/<metric>"`` -> float, batch-level metrics the functions reported
                   (``RewardFunction.score_with_metrics``), e.g. ``shape_verifier/fidelity``.
    """

    rewards_B: Tensor
    per_function: dict[str, Tensor]
    num_nonfinite: int
    function_metrics: dict[str, float] = field(default_factory=dict)
    num_errors: int = 0
    errors_per_function: dict[str, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Detached floats for logging: mean over finite entries and non-finite fraction, per function
        and for the total (NaN mean when no entry is finite)."""
        out: dict[str, float] = {}
        items = [("reward", self.rewards_B)] + [(f"rewards/{k}", v) for k, v in self.per_function.items()]
        for key, values in items:
            finite = torch.isfinite(values)
            n = int(finite.sum())
            out[f"{key}/mean"] = float(values[finite].double().mean()) if n else math.nan
            out[f"{key}/frac_nonfinite"] = 1.0 - n / values.numel() if values.numel() else 0.0
        out.update({f"rewards/{k}": v for k, v in self.function_metrics.items()})
        out["reward/num_errors"] = float(self.num_errors)
        return out


class CombinedReward:
    """Weighted sum of reward functions, scored on one batch.

    ``rewards``: ``RewardFunction``s, plain callables (weight 1) or registry names (``get_reward(name)``).
    ``weights``: when given, one per reward, replacing each ``RewardFunction.weight``.
    ``on_nonfinite``:
        ``"nan"`` (default): the total is NaN wherever any component with non-zero weight is not finite.
            A missing score is never silently read as 0; the advantage estimators exclude NaN rewards
            from baselines and give them advantage 0, so such samples simply do not train.
        ``"skip"``: TRL's ``nansum``: non-finite components are left out of the sum; the total is NaN
            only where every weighted component is non-finite. Use it when rewards return ``None`` for
            samples they do not apply to (multi-task data).
    ``on_error``: ``"raise"`` (default): a function that raises or returns something unusable raises
        ``RewardError`` naming it and the sample. ``"skip"``: those samples are counted (``num_errors``)
        and their total is NaN (whatever ``on_nonfinite`` says), so they train like NaN rewards.
    ``timeout_s``: seconds each function may take on one batch (None or 0: no limit); an overrun raises
        ``RewardTimeoutError`` (``"raise"``) or scores that function's batch NaN, every sample counted as an
        error (``"skip"``). The trainer passes ``--reward_timeout`` per call.
    Components with weight 0 are computed and reported in ``per_function`` but never affect the total.
    Names must be unique (set ``RewardFunction(name=...)`` to tell two uses of one function apart).
    Scores are combined in float64 (``rewards_B`` is float64).
    """

    def __init__(self, rewards: Sequence[Any], weights: Sequence[float] | None = None,
                 on_nonfinite: str = "nan", on_error: str = "raise", timeout_s: float | None = None) -> None:
        if not rewards:
            raise ValueError("CombinedReward needs at least one reward function")
        if on_nonfinite not in ("nan", "skip"):
            raise ValueError(f"on_nonfinite must be 'nan' or 'skip', got {on_nonfinite!r}")
        if on_error not in ON_ERROR:
            raise ValueError(f"reward_errors must be 'raise' or 'skip', got {on_error!r}")
        if weights is not None and len(weights) != len(rewards):
            raise ValueError(f"{len(weights)} weights for {len(rewards)} reward functions")
        functions = []
        for i, r in enumerate(rewards):
            if isinstance(r, str):
                r = get_reward(r)
            rf = r if isinstance(r, RewardFunction) else RewardFunction(r)
            if weights is not None:
                rf = RewardFunction(rf.fn, name=rf.name, weight=weights[i], kwargs=rf.kwargs)
            functions.append(rf)
        names = [f.name for f in functions]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward names must be unique; repeated: {duplicates}")
        self.functions: list[RewardFunction] = functions
        self.on_nonfinite, self.on_error, self.timeout_s = on_nonfinite, on_error, timeout_s

    @property
    def weights(self) -> list[float]:
        return [f.weight for f in self.functions]

    def __call__(self, prompts: list[Any], completions: list[Any],
                 columns: dict[str, list[Any]] | None = None, on_error: str | None = None,
                 timeout_s: float | None = None, step: int | None = None) -> RewardOutput:
        """Score the batch with every function and combine (see the class docstring for NaN rules);
        ``on_error`` and ``timeout_s`` override the instance's for this call (``timeout_s`` 0: no limit);
        ``step`` names the training step in a timeout's message. Each function gets its own copy of the
        batch (``fresh_copy``)."""
        on_error = on_error or self.on_error
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        per_function, function_metrics, errors = {}, {}, {}
        for f in self.functions:
            per_function[f.name], metrics, errors[f.name] = f.score_checked(prompts, completions, columns, on_error,
                                                                            timeout_s, step)
            function_metrics.update({f"{f.name}/{k}": v for k, v in metrics.items()})
        batch_size = len(completions)
        scores_F_B = torch.stack(list(per_function.values())) if per_function else torch.zeros(0, batch_size)
        errors_F_B = torch.stack(list(errors.values())) if errors else torch.zeros(0, batch_size, dtype=torch.bool)
        weights_F = torch.tensor(self.weights, dtype=torch.float64)
        used = weights_F != 0
        scores_F_B, weights_F, errors_F_B = scores_F_B[used].double(), weights_F[used], errors_F_B[used]
        finite_F_B = torch.isfinite(scores_F_B)
        total_B = (weights_F[:, None] * torch.where(finite_F_B, scores_F_B, torch.zeros_like(scores_F_B))).sum(0)
        if weights_F.numel():
            bad_B = ~finite_F_B.all(0) if self.on_nonfinite == "nan" else ~finite_F_B.any(0)
            bad_B = bad_B | errors_F_B.any(0)
            total_B = torch.where(bad_B, torch.full_like(total_B, math.nan), total_B)
        all_errors_B = torch.stack(list(errors.values())).any(0) if errors \
            else torch.zeros(batch_size, dtype=torch.bool)
        return RewardOutput(rewards_B=total_B, per_function=per_function,
                            num_nonfinite=int((~torch.isfinite(total_B)).sum()), function_metrics=function_metrics,
                            num_errors=int(all_errors_B.sum()),
                            errors_per_function={k: int(v.sum()) for k, v in errors.items()})
