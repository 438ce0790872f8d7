"""The offline pairwise loop: DPO (text and Diffusion-DPO alike) and Bradley-Terry reward models.

    1. batch     ``batch_size`` pairs per optimizer step from an epoch-seeded permutation, built into a
                 ``PreferenceBatch`` by the objective's model (tokenised text, or encoded latents with a
                 timestep and noise shared by each pair)
    2. loss      the objective's per-pair losses (``algos.dpo_loss`` / ``algos.bradley_terry_loss``),
                 summed over micro-batches and divided by the number of pairs in the whole step
    3. update    clip, step (skipped, and counted, when the loss or gradient is not finite)
    4. log/save  metrics, atomic checkpoints, resumable; loss/accuracy curves

The objectives are small adapters from a model to per-pair losses; the loop never asks which
modality it runs. ``DPOObjective`` (= ``PairObjective``) runs any registered pair loss (``algos.PAIR_LOSSES``:
the DPO family, SimPO, ORPO); where the loss needs one it takes the reference from ``policy.reference()``
(adapters disabled under LoRA, else a frozen copy) and can cache its log-likelihoods per row.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather

from unialign import algos
from unialign.algos.pair_losses import check_pair_loss_params
from unialign.config import arg
from unialign.files import write_with
from unialign.trainers.checkpoint import preserved_random_state
from unialign.trainers.loop import TrainerLoop
from unialign.trainers.outputs import save_curves
from unialign.trainers.schedule import epoch_order
from unialign.trainers.train_config import TrainConfig
from unialign.types import PreferenceBatch


@dataclass
class PreferenceConfig(TrainConfig):
    """Knobs of the pairwise loop."""

    batch_size: int = arg(16, "preference pairs per optimizer step (all processes together)", group="optimisation",
                          min=1)
    micro_batch_size: int = arg(8, "pairs per forward/backward pass (memory only; the update is the same)",
                                group="optimisation", min=1)
    output_dir: str = arg("outputs/preference", "folder for checkpoints, logs, curves, summary.json and final/")
    eval_batch_size: int = arg(32, "pairs per batch when evaluating", group="logging", min=1)
    eval_steps: int = arg(0, "evaluate the trainer's held-out pairs (eval_rows) every N steps, logged and "
                             "plotted as eval/* (0: only when a script asks)", group="logging", min=0)


def implicit_accuracy(chosen_B: torch.Tensor, rejected_B: torch.Tensor) -> torch.Tensor:
    """Fraction of pairs ranked right; ties count 1/2 (the diffusers Diffusion-DPO convention)."""
    return ((chosen_B > rejected_B).float() + 0.5 * (chosen_B == rejected_B).float()).mean()


class RowObjective:
    """What ``PreferenceTrainer`` trains: ``batch(rows)``, ``losses(batch, row_ids)`` -> (per-row losses [B], metrics),
    ``model``, ``parameters()``. The step's loss is the mean of the per-row losses over the step's rows;
    ``begin_step`` hears which rows a step holds (every process's), for an objective whose normaliser is not the
    row count (SFT's token mean)."""

    def begin_step(self, row_ids: list[int]) -> None:
        pass


class PairObjective(RowObjective):
    """Per-pair losses of a policy under a registered pair loss (``algos.PAIR_LOSSES``, through ``algos.dpo_loss``).

    The entry's data decide everything variant-specific: ``needs_reference`` (the reference comes from
    ``policy.reference()`` and may be cached per row; without it no reference is built, loaded or run),
    ``length_normalize`` (length-averaged log-likelihoods: IPO, SimPO, ORPO) and ``nll_coef``.
    ``loss_params`` are the entry's own keywords (SimPO's ``gamma``; its defaults otherwise). On diffusion
    the ELBO surrogate's margins are small (~1e-4): SimPO's beta belongs on Diffusion-DPO's scale (thousands).

    ``rpo_alpha`` (TRL's name; RPO, Pang et al. 2024, "Iterative Reasoning Preference Optimization",
    eq. 3) is the weight of ``algos.chosen_nll_loss``, NLL = −log π(y_w|x) / |y_w| (per completion token
    for text; for diffusion the ELBO surrogate, i.e. the plain denoising loss of the chosen image); None:
    the entry's ``nll_coef`` (1 for ``rpo`` and ``orpo``, whose loss includes it, else 0). Plain DPO lowers
    the likelihood of *both* sides; the NLL term keeps the chosen one up.
    """

    def __init__(self, policy, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 cache_reference: bool = False, rpo_alpha: float | None = None,
                 loss_params: dict[str, float] | None = None):
        self.entry = check_pair_loss_params(loss_type, label_smoothing, **(loss_params or {}))
        self.policy, self.beta, self.loss_type, self.label_smoothing = policy, beta, loss_type, label_smoothing
        self.rpo_alpha, self.loss_params = rpo_alpha, dict(loss_params or {})
        self.nll_coef = self.entry.nll_coef if rpo_alpha is None else rpo_alpha
        # before any update: a full-model reference is copied here; none at all for reference-free losses
        self.reference = policy.reference() if self.entry.needs_reference else None
        self.cache: dict[int, tuple[float, float]] | None = {} if cache_reference else None

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    def resume_settings(self) -> dict[str, Any]:
        """The objective's knobs a resume must not change silently."""
        return {"objective": "dpo", "beta": self.beta, "loss_type": self.loss_type,
                "label_smoothing": self.label_smoothing, "rpo_alpha": self.rpo_alpha,
                **({"loss_params": self.loss_params} if self.loss_params else {})}

    def parameters(self):
        return self.policy.trainable_parameters()

    def batch(self, rows: list[dict[str, Any]]) -> PreferenceBatch:
        return self.policy.preference_batch(rows)

    def precompute(self, rows: list[dict[str, Any]], batch_size: int, path: str | Path | None = None) -> None:
        """Fill the reference cache for every row (loading it from ``path`` when present and whole, saving it there
        otherwise). Key ``path`` by ``fingerprint(rows, model)``. The file is safetensors (row ids and the two
        log-probs, float64), written through a temporary file renamed into place; one that is damaged (truncated,
        unreadable, not one value pair per row, non-finite) is reported on stderr and rebuilt. Valid when
        ``preference_batch`` is a deterministic function of the rows (text; not diffusion, whose pairs draw t and
        noise). Nothing to do for a reference-free loss."""
        if self.reference is None:
            return
        if self.cache is None:
            self.cache = {}
        if path is not None and Path(path).exists():
            loaded = _read_reference_cache(Path(path), len(rows))
            if loaded is not None:
                self.cache.update(loaded)
                return
        with torch.no_grad():
            for i in range(0, len(rows), batch_size):
                ids = list(range(i, min(i + batch_size, len(rows))))
                self._reference_logps(self.batch([rows[j] for j in ids]), ids)
        if path is not None:
            _write_reference_cache(Path(path), {i: self.cache[i] for i in range(len(rows))})

    def _reference_logps(self, batch: PreferenceBatch, row_ids: list[int] | None):
        if self.cache is not None and row_ids is not None and all(i in self.cache for i in row_ids):
            pairs = torch.tensor([self.cache[i] for i in row_ids])
            return pairs[:, 0], pairs[:, 1]
        ref_c, ref_r = self.reference.sequence_log_prob(batch, length_normalize=self.entry.length_normalize)
        if self.cache is not None and row_ids is not None:
            self.cache.update({i: (float(c), float(r)) for i, c, r in zip(row_ids, ref_c, ref_r)})
        return ref_c, ref_r

    def sequence_logps(self, batch: PreferenceBatch, row_ids: list[int] | None = None):
        """(chosen, rejected, ref_chosen, ref_rejected) [B] each: the policy's and the reference's (cached
        when ``row_ids`` are in the cache) sequence log-probs, length-averaged where the loss says so.
        Without a reference (SimPO, ORPO) the last two are zeros and no reference runs."""
        chosen, rejected = self.policy.sequence_log_prob(batch, length_normalize=self.entry.length_normalize)
        if self.reference is None:
            return chosen, rejected, torch.zeros_like(chosen.detach()), torch.zeros_like(rejected.detach())
        ref_c, ref_r = self._reference_logps(batch, row_ids)
        return chosen, rejected, ref_c.to(chosen.device, chosen.dtype), ref_r.to(chosen.device, chosen.dtype)

    def losses(self, batch: PreferenceBatch, row_ids: list[int] | None = None):
        chosen, rejected, ref_c, ref_r = self.sequence_logps(batch, row_ids)
        refs = (ref_c, ref_r) if self.reference is not None else (None, None)
        losses, rc, rr = algos.dpo_loss(chosen, rejected, *refs, self.beta, self.loss_type, self.label_smoothing,
                                        **self.loss_params)
        extra = {}
        if self.nll_coef:
            length = None if self.entry.length_normalize else batch.chosen_length_B
            nll = algos.chosen_nll_loss(chosen, length)
            losses = losses + self.nll_coef * nll
            extra["nll_loss"] = nll.detach().mean()
        margins = (rc - rr).mean()
        # TRL's DPOTrainer names (rewards/margins, rewards/accuracies: a tie counts 0) beside unialign's own
        # (rewards/margin, implicit_accuracy: a tie counts 1/2, the before-training value 0.5)
        metrics = {**extra, "rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(), "rewards/margins": margins,
                   "rewards/margin": margins, "rewards/accuracies": (rc > rr).float().mean(),
                   "implicit_accuracy": implicit_accuracy(rc, rr),
                   "logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean()}
        if self.reference is not None:
            metrics.update({"ref_logps/chosen": ref_c.mean(), "ref_logps/rejected": ref_r.mean()})
        return losses, metrics


DPOObjective = PairObjective  # the name the scripts, tests and README use


class BradleyTerryObjective(RowObjective):
    """Bradley-Terry reward-model training (``algos.bradley_terry_loss``, optional margin and centring)."""

    def __init__(self, reward_model, center_coef: float = 0.0):
        self.reward_model, self.center_coef = reward_model, center_coef

    @property
    def model(self) -> torch.nn.Module:
        return self.reward_model.model

    def resume_settings(self) -> dict[str, Any]:
        """The objective's knobs a resume must not change silently."""
        return {"objective": "bradley_terry", "center_coef": self.center_coef}

    def parameters(self):
        return self.reward_model.trainable_parameters()

    def batch(self, rows: list[dict[str, Any]]) -> PreferenceBatch:
        return self.reward_model.preference_batch(rows)

    def losses(self, batch: PreferenceBatch, row_ids: list[int] | None = None):
        sc, sr = self.reward_model.pair_scores(batch)
        margin = batch.margin_B.to(sc.device, sc.dtype) if batch.margin_B is not None else None
        losses = algos.bradley_terry_loss(sc, sr, margin, self.center_coef)
        both = torch.cat([sc.detach(), sr.detach()])
        margin = (sc - sr).detach().mean()
        # TRL's RewardTrainer names (margin, min / mean / max_reward) beside unialign's (rewards/*)
        metrics = {"accuracy": implicit_accuracy(sc.detach(), sr.detach()), "rewards/chosen": sc.detach().mean(),
                   "rewards/rejected": sr.detach().mean(), "rewards/margin": margin, "margin": margin,
                   "min_reward": both.min(), "mean_reward": both.mean(), "max_reward": both.max()}
        return losses, metrics


class SFTObjective(RowObjective):
    """Supervised fine-tuning (TRL's ``SFTTrainer`` loss): the negative log-likelihood of each row's completion
    given its prompt, the mean over every completion token of the optimizer step (TRL's token mean, across
    micro-batches and processes), through the policy's ``completion_log_prob`` -- a causal LM's token
    log-probs, a masked-diffusion LM's estimator terms (LLaDA's SFT: the masked tokens' cross-entropy weighted 1 /
    t). Rows: ``{"prompt", "completion"}`` (``unialign.text.sft.sft_rows``); the prompt's tokens are never trained."""

    def __init__(self, policy, rows: list[dict[str, Any]] | None = None):
        self.policy, self.rows = policy, rows
        self._lengths: dict[int, int] = {}
        self._step_tokens: float | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    def resume_settings(self) -> dict[str, Any]:
        return {"objective": "sft"}

    def parameters(self):
        return self.policy.trainable_parameters()

    def batch(self, rows: list[dict[str, Any]]) -> PreferenceBatch:
        return self.policy.preference_batch([{"prompt": r["prompt"], "chosen": r["completion"],
                                              "rejected": r["completion"]} for r in rows])

    def _length(self, i: int) -> int:
        """Row ``i``'s trained tokens: its completion's (a string, as ``sft_rows`` gives it) and the EOS after it, as
        ``preference_batch`` encodes them (the tokenizer alone: no random state moves)."""
        if i not in self._lengths:
            ids = self.policy.tokenizer.encode(self.rows[i]["completion"], add_special_tokens=False)
            self._lengths[i] = len(ids) + 1
        return self._lengths[i]

    def begin_step(self, row_ids: list[int]) -> None:
        """The step's completion tokens (every process's rows): the token mean's denominator."""
        self._step_tokens = float(sum(self._length(i) for i in row_ids)) / max(1, len(row_ids))

    def losses(self, batch: PreferenceBatch, row_ids: list[int] | None = None):
        logp = self.policy.completion_log_prob(batch.chosen)
        tokens = batch.chosen["completion_mask"].to(logp.device, logp.dtype).sum(-1)
        nll = -logp.sum(-1)
        # the loop averages per-row losses over the step's rows: row NLL / (tokens per row of the step) makes that
        # mean the step's token mean; outside a step (evaluation) the batch's own token mean
        per_row = self._step_tokens if (row_ids is not None and self._step_tokens) else float(tokens.mean())
        losses = nll / max(per_row, 1.0)
        metrics = {"completion_tokens": tokens.sum().detach(), "nll_per_token": (nll.sum() / tokens.sum().clamp(min=1)).detach()}
        return losses, metrics


class PreferenceTrainer(TrainerLoop):
    """Trains ``objective`` on preference ``rows``. ``eval_rows`` (optional held-out pairs) are evaluated
    by ``evaluate()`` every ``eval_steps`` and at the end; their numbers go to the trackers and the history
    as ``eval/*`` (and so into the loss curve)."""

    def __init__(self, objective, rows: list[dict[str, Any]], config: PreferenceConfig,
                 accelerator: Accelerator | None = None, eval_rows: list[dict[str, Any]] | None = None):
        if not rows:
            raise ValueError("preference rows: the training set is empty")
        self.obj, self.rows = objective, rows
        self.progress_desc = "pairs"
        self._open(config, rows, dict(batch_size=config.batch_size, **getattr(objective, "resume_settings", dict)()),
                   accelerator)
        if config.batch_size % self.acc.num_processes:
            raise ValueError(f"batch_size={config.batch_size} must be divisible by the {self.acc.num_processes} processes")
        _set_model(objective, self._prepare(objective.model, list(objective.parameters())))
        self.counters = {"skipped_steps": 0}
        self.eval_rows = eval_rows

    def _next_rows(self) -> list[int]:
        ids = epoch_order(self.cursor, len(self.rows), self.cfg.batch_size, self.cfg.seed)
        self.cursor += len(ids)
        return ids

    def train_step(self) -> dict[str, float]:
        cfg, acc = self.cfg, self.acc
        t0 = time.perf_counter()
        ids = self._next_rows()
        self.obj.begin_step(ids)
        per = len(ids) // acc.num_processes
        mine = ids[acc.process_index * per:(acc.process_index + 1) * per]
        micro = [mine[i:i + cfg.micro_batch_size] for i in range(0, len(mine), cfg.micro_batch_size)]
        metrics: dict[str, list[float]] = {}
        model = self.obj.model
        model.train()
        total = 0.0
        for j, chunk in enumerate(micro):
            ctx = acc.no_sync(model) if j < len(micro) - 1 else contextlib.nullcontext()
            with ctx:
                with self.autocast():  # --mixed_precision (a no-op without it)
                    losses, m = self.obj.losses(self.obj.batch([self.rows[i] for i in chunk]), chunk)
                loss = losses.sum() / per  # the mean over this process's pairs; DDP averages processes
                acc.backward(loss)
            total += float(loss.detach())
            for k, v in m.items():
                metrics.setdefault(k, []).append(float(v) * len(chunk))
        grad_norm = acc.clip_grad_norm_(list(self.obj.parameters()), cfg.max_grad_norm)
        grad_norm = float(grad_norm) if grad_norm is not None else math.nan
        if math.isfinite(grad_norm) and math.isfinite(total):
            self.optimizer.step()
        else:
            self.counters["skipped_steps"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        out = {k: sum(v) / len(mine) for k, v in metrics.items()}
        out.update({"loss": float(gather(torch.tensor([total], device=acc.device)).mean()), "grad_norm": grad_norm,
                    "pairs_per_second": cfg.batch_size / (time.perf_counter() - t0)})
        return out

    def evaluate(self, rows: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """Per-pair means over ``rows`` (default: the trainer's ``eval_rows``), e.g. held-out implicit
        accuracy, no gradient. For ``eval_rows`` the numbers are also logged (``eval/<name>``) to the
        trackers and this step's history entry, and cached per step (asking twice computes once)."""
        if rows is None:
            if self.eval_rows is None:
                raise ValueError("evaluate(): no rows given and the trainer has no eval_rows")
            rows = self.eval_rows
        if rows is not self.eval_rows:
            return self._evaluate(rows)
        cached = self._cached_eval()
        if cached is not None:
            return {k.removeprefix("eval/"): v for k, v in cached.items()}
        out = self._evaluate(rows)
        self._record_eval({f"eval/{k}": v for k, v in out.items()})
        return out

    @torch.no_grad()
    def _evaluate(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        self.obj.model.eval()
        sums: dict[str, float] = {}
        bs = self.cfg.eval_batch_size
        for i in range(0, len(rows), bs):
            chunk = rows[i:i + bs]
            losses, m = self.obj.losses(self.obj.batch(chunk))
            for k, v in {"loss": losses.mean(), **m}.items():
                sums[k] = sums.get(k, 0.0) + float(v) * len(chunk)
        return {k: v / max(1, len(rows)) for k, v in sums.items()}

    def save_curves(self) -> None:
        """``loss_curve.png``: loss, accuracies (training and held-out), reward margin, lr when it varies."""
        lr_varies = len({h["lr"] for h in self.history if "lr" in h}) > 1
        evals = [f"eval/{k}" for k in ("loss", "implicit_accuracy", "accuracy")]
        save_curves(self.history, Path(self.cfg.output_dir) / "loss_curve.png",
                    ("loss", "implicit_accuracy", "accuracy", *evals, "rewards/margin", *(("lr",) if lr_varies else ())),
                    smooth=("loss", "implicit_accuracy", "accuracy"))

    def _progress(self, stats: dict[str, Any]) -> dict[str, str]:
        return {"loss": f"{stats['loss']:.4f}"}

    def _scheduled_eval(self) -> None:
        """``evaluate()`` on ``eval_rows`` without moving the training RNG (Diffusion-DPO's evaluation
        draws timesteps and noise): a run gives the same updates with or without ``eval_steps``."""
        if self.eval_rows is None:
            return
        with preserved_random_state(self._random_sources()):
            metrics = self.evaluate()
        self._fire("on_evaluate", metrics={f"eval/{k}": v for k, v in metrics.items()})

    def _random_sources(self) -> dict[str, Any]:
        owner = self.obj.policy if hasattr(self.obj, "policy") else getattr(self.obj, "reward_model", None)
        return {"objective": self.obj, "policy": owner}


@torch.no_grad()
def averaged_implicit_accuracy(objective: PairObjective, rows: list[dict[str, Any]], samples: int,
                               batch_size: int) -> float:
    """Implicit accuracy over ``rows`` with each pair's reward margin averaged over ``samples`` independent
    ``objective.batch`` draws: the quantity ``PreferenceTrainer.evaluate`` reports (ties count 1/2), with a
    lower-variance estimate where the log-prob is stochastic (Diffusion-DPO's ELBO surrogate draws t, eps
    and the VAE posterior sample per batch; for text, every draw is the same)."""
    objective.model.eval()
    margin = torch.zeros(len(rows))
    for _ in range(samples):
        for i in range(0, len(rows), batch_size):
            chosen, rejected, ref_c, ref_r = objective.sequence_logps(objective.batch(rows[i:i + batch_size]))
            margin[i:i + len(chosen)] += ((chosen - ref_c) - (rejected - ref_r)).float().cpu()
    return float(implicit_accuracy(margin, torch.zeros_like(margin)))


def _set_model(objective, prepared: torch.nn.Module) -> None:
    owner = objective.policy if hasattr(objective, "policy") else objective.reward_model
    owner.model = prepared


def fingerprint(rows: list[dict[str, Any]], model: torch.nn.Module) -> str:
    """A key for cached reference values: the data and the model's weights."""
    h = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode())
    for p in model.state_dict().values():
        h.update(p.detach().float().cpu().numpy().tobytes()[:4096])
    return h.hexdigest()[:16]


def _write_reference_cache(path: Path, cache: dict[int, tuple[float, float]]) -> None:
    from safetensors.torch import save_file

    ids = sorted(cache)
    tensors = {"row_ids": torch.tensor(ids, dtype=torch.int64),
               "ref_logps": torch.tensor([cache[i] for i in ids], dtype=torch.float64).reshape(len(ids), 2)}
    write_with(path, lambda tmp: save_file(tensors, str(tmp)), f"the reference log-prob cache {path}")


def _read_reference_cache(path: Path, n_rows: int) -> dict[int, tuple[float, float]] | None:
    """The cache at ``path`` when it is whole (one finite pair for each of rows 0 .. n_rows - 1), else None after
    saying on stderr why it is rebuilt."""
    from safetensors.torch import load_file

    try:
        data = load_file(str(path))
        ids, values = data["row_ids"], data["ref_logps"]
        ok = (ids.tolist() == list(range(n_rows)) and tuple(values.shape) == (n_rows, 2)
              and bool(torch.isfinite(values).all()))
    except Exception as err:  # noqa: BLE001 - any unreadable file is rebuilt, never trusted
        ok, why = False, f"{type(err).__name__}: {str(err)[:100]}"
    else:
        why = "not one finite pair of log-probs per training row"
    if not ok:
        print(f"warning: {path}: damaged reference cache ({why}); recomputing it", file=sys.stderr)
        return None
    return {int(i): (float(c), float(r)) for i, (c, r) in zip(ids, values.tolist())}
