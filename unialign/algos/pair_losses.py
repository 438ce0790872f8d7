"""Pair losses as registered functions: the DPO family and the reference-free SimPO / ORPO.

Every entry of ``PAIR_LOSSES`` is one function ``fn(chosen_B, rejected_B, beta, **params) -> losses_B``
plus the data the objective needs to feed it:

    needs_reference   the inputs are log-ratios log pi(y|x) - log pi_ref(y|x) (a reference is built and
                      run); otherwise they are the policy's own log-likelihoods and no reference exists
    length_normalize  the log-likelihoods are means over the completion (per token for text; the diffusion
                      ELBO surrogate -1/2 mean_CHW ||eps - eps_theta||^2 is a per-element mean already)
    params            the keyword parameters besides beta (read from the signature: label_smoothing, gamma)
    defaults          beta's and the parameters' published defaults (read from the signature: SimPO beta 2,
                      gamma 0.5); a script fills an unset flag from them
    nll_coef          weight of the chosen side's NLL (``chosen_nll_loss``) the method adds by definition
                      (RPO and ORPO: 1; an objective's ``rpo_alpha`` overrides it)

The same functions train a language model and a diffusion model: only what the policy returns as a
sample's log-likelihood differs (``unialign.types``). Adding a variant is one function under
``@register_pair_loss(...)`` and its test; ``trainers.preference.DPOObjective`` looks entries up by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unialign.algos.named import add_new, lookup

Tensor = torch.Tensor
PairLossFn = Callable[..., Tensor]  # (chosen_B, rejected_B, beta, **params) -> losses_B


@dataclass(frozen=True)
class PairLoss:
    """A registered pair loss: the function and how to feed it (see the module docstring)."""

    name: str
    fn: PairLossFn
    needs_reference: bool
    length_normalize: bool
    params: tuple[str, ...] = ()
    nll_coef: float = 0.0
    defaults: tuple[tuple[str, float], ...] = ()


PAIR_LOSSES: dict[str, PairLoss] = {}


def register_pair_loss(name: str, *, needs_reference: bool, length_normalize: bool,
                       nll_coef: float = 0.0) -> Callable[[PairLossFn], PairLossFn]:
    """Decorator: register ``fn(chosen_B, rejected_B, beta, **params) -> losses_B`` under ``name``."""

    def add(fn: PairLossFn) -> PairLossFn:
        signature = list(inspect.signature(fn).parameters.values())
        params = tuple(p.name for p in signature[3:])
        defaults = tuple((p.name, p.default) for p in signature[2:] if p.default is not inspect.Parameter.empty)
        add_new(PAIR_LOSSES, name, PairLoss(name, fn, needs_reference, length_normalize, params, nll_coef, defaults),
                "pair loss")
        return fn

    return add


def get_pair_loss(name: str) -> PairLoss:
    """The registry entry ``name``; a ValueError naming the registered ones otherwise."""
    return lookup(PAIR_LOSSES, name, "pair loss (loss_type)")


def check_pair_loss_params(name: str, label_smoothing: float = 0.0, **params: float) -> PairLoss:
    """The entry ``name`` after checking its parameters: ``label_smoothing`` in [0, 1/2) and only where the
    loss takes it, no keyword it does not take. Raises ValueError naming the parameter."""
    entry = get_pair_loss(name)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and "label_smoothing" not in entry.params:
        takes = [n for n, e in PAIR_LOSSES.items() if "label_smoothing" in e.params]
        raise ValueError(f"label_smoothing applies to {takes} only, not {name!r}")
    unknown = sorted(set(params) - set(entry.params))
    if unknown:
        raise ValueError(f"pair loss {name!r} takes no parameter {unknown[0]!r} (it takes {entry.params})")
    return entry


# ----------------------------------------------------------------------------- the DPO family
# Inputs: chosen / rejected log-ratios [B], r = log pi(y|x) - log pi_ref(y|x); h = r_w - r_l below. beta 0.1: the
# papers' and TRL's default.
@register_pair_loss("sigmoid", needs_reference=True, length_normalize=False)
def dpo_sigmoid_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float = 0.1,
                     label_smoothing: float = 0.0) -> Tensor:
    """DPO (Rafailov et al. 2023, eq. 7); eps = label_smoothing > 0 is conservative DPO (cDPO, Mitchell 2023):

        L = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)        -> losses_B
    """
    h = chosen_logratios - rejected_logratios
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


@register_pair_loss("ipo", needs_reference=True, length_normalize=True)
def ipo_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float = 0.1) -> Tensor:
    """IPO (Azar et al. 2023, eq. 17) on length-averaged log-likelihoods, as the paper and TRL:

        L = (h - 1 / (2 beta))^2                                         -> losses_B
    """
    return (chosen_logratios - rejected_logratios - 1 / (2 * beta)) ** 2


@register_pair_loss("hinge", needs_reference=True, length_normalize=False)
def hinge_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float = 0.1) -> Tensor:
    """SLiC-HF (Zhao et al. 2023, eq. 3) with beta = 1/delta:  L = max(0, 1 - beta h)  -> losses_B."""
    return torch.relu(1 - beta * (chosen_logratios - rejected_logratios))


@register_pair_loss("robust", needs_reference=True, length_normalize=False)
def robust_dpo_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float = 0.1,
                    label_smoothing: float = 0.0) -> Tensor:
    """Robust DPO (Chowdhury et al. 2024, eq. 10), unbiased under a label-flip rate eps < 1/2:

        L = [-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)] / (1 - 2 eps)   -> losses_B
    """
    h = chosen_logratios - rejected_logratios
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)


# RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 3): DPO plus the chosen NLL
register_pair_loss("rpo", needs_reference=True, length_normalize=False, nll_coef=1.0)(dpo_sigmoid_loss)


# ----------------------------------------------------------------------------- reference-free
# Inputs: the policy's own length-averaged log-likelihoods [B]; no reference model.
@register_pair_loss("simpo", needs_reference=False, length_normalize=True)
def simpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, beta: float = 2.0, gamma: float = 0.5) -> Tensor:
    """SimPO (Meng et al. 2024, eq. 6): a length-averaged reward with a target margin gamma, no reference:

        L = -log sigma(beta (avg log pi(y_w|x) - avg log pi(y_l|x)) - gamma)     -> losses_B
    """
    return -F.logsigmoid(beta * (chosen_avg_logps - rejected_avg_logps) - gamma)


def log_odds(avg_logps: Tensor) -> Tensor:
    """log(p / (1 - p)) for p = exp(avg_logps) [B], stably: avg_logps - log(-expm1(avg_logps)). Inputs are
    clamped to at most -tiny (the dtype's smallest normal number), so a side the model is certain of
    (log-likelihood exactly 0 in floating point) gives a large finite log-odds, not inf - inf."""
    x = avg_logps.clamp(max=-torch.finfo(avg_logps.dtype).tiny)
    return x - torch.log(-torch.expm1(x))


@register_pair_loss("orpo", needs_reference=False, length_normalize=True, nll_coef=1.0)
def orpo_odds_ratio_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, beta: float = 0.1) -> Tensor:
    """ORPO's odds-ratio term (Hong et al. 2024, eqs. 4-7; beta is the paper's lambda), no reference:

        L_OR = -beta log sigma(log odds(y_w) - log odds(y_l)),  log odds = avg_logp - log(1 - exp(avg_logp))

    -> losses_B. ORPO's full loss adds the chosen side's length-averaged NLL (the entry's nll_coef = 1).
    """
    return -beta * F.logsigmoid(log_odds(chosen_avg_logps) - log_odds(rejected_avg_logps))


def chosen_nll_loss(chosen_logps: Tensor, chosen_length: Tensor | None = None) -> Tensor:
    """The chosen side's NLL per unit, -log pi(y_w|x) / |y_w| [B] (RPO, Pang et al. 2024, eq. 3; ORPO's
    L_SFT). ``chosen_length`` [B] (completion tokens) divides summed log-likelihoods; pass None when they
    are length-averaged already, or for the diffusion ELBO surrogate (then the plain denoising loss / 2)."""
    if chosen_length is None:
        return -chosen_logps
    return -chosen_logps / chosen_length.to(chosen_logps).clamp(min=1)
