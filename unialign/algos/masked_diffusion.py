"""Log-prob estimators of masked-diffusion language models: one registered function per method, one signature.

A masked-diffusion LM (LLaDA, Dream, DiffuCoder, a ModernBERT chat model) has no exact sequence log-prob: it
predicts every masked token of a partly masked sequence at once. RL on it needs an *estimate* of the completion's
token log-probs, ``logp_B_T``, whose sum over the completion estimates log p(completion | prompt). Every estimator
here masks the sequence in some way, asks the model for the log-probs of the clean tokens at the masked positions
(``score``), and weights them:

    one_step         d1 / diffu-GRPO (Zhao et al. 2025, arXiv 2504.12216): the completion fully masked, prompt
                     tokens masked with probability ``p_mask_prompt``; one forward.
    coupled          DiffuCoder's coupled-GRPO (Gong et al. 2025, arXiv 2506.20639): a mask at ratio t ~ U[t_min,
                     t_max] and its complement, so every token is scored exactly once by the pair, each weighted 1/t
                     (1/(1-t)), averaged with the fully masked pass as its reference code does; three forwards.
    elbo_mc          the ELBO E_t[1/t * sum_masked log p(x_i | x_t)] by ``num_t`` stratified times (LLaDA's
                     likelihood); ``num_t`` forwards. Unbiased for the ELBO.
    elbo_quadrature  GDPO (NVIDIA-NeMo/RL research/gdpo): the ELBO's time integral by Gauss-Legendre quadrature at
                     ``num_t`` nodes, each with a stratified mask of exactly ceil(t * T) tokens; ``num_t`` forwards.
    spg              SPG (Wang et al. 2025, arXiv 2510.09541): the ELBO (``elbo_mc``'s masks) for samples of
                     positive advantage, the EUBO 1/beta * log E_t[p(x_i | x_t)^beta * 1[masked] / t] for negative
                     ones (``sign_B``); both bounds come from the same forwards (``spg_bounds``).
    trace            TraceRL (Gen-Verse/dLLM-RL): the sampler's own unmasking trace replayed: the token unmasked at
                     step s scored on the sequence as it was before step s (``step_map_B_T``); one forward per
                     distinct step (``trace_shrink`` merges consecutive steps).
    ar_order         JustGRPO (LeapLabTHU/JustGRPO): the exact log-prob of the left-to-right order, token j scored
                     with tokens < j revealed and tokens >= j masked (sampling with block length 1 follows it); T
                     forwards.

The exact values these estimate, by enumeration on a tiny model (``tests/algos/test_masked_diffusion.py``): the ELBO
is the mean over all unmasking orders sigma of sum_j log p(x_sigma(j) | x_sigma(<j)) (equivalently
sum_k 1/k * mean_{|S|=k} sum_{i in S} log p(x_i | x_-S)), and the any-order log-likelihood log mean_sigma p_sigma(x)
is above it (Jensen).

**Masks come from the sequences' seeds, never from a global RNG** (``seed_B``: one per sample, drawn when it was
sampled and kept in its trajectory): old, reference and current log-probs of one update are computed on the same
masks by construction, micro-batching does not change them, and the first on-policy ratio is exactly 1 (d1's
``mask_seeds``; NeMo-RL's rule).

Shapes: P prompt positions (left-padded), T completion positions (the generated block, EOS-filled after the
answer), B samples, R replicas of the batch in one scoring call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from unialign.algos.named import add_new, lookup

Tensor = torch.Tensor

#: ``score(noisy_prompt_N_P, noisy_completion_N_T, replicas) -> logp_N_T``: the model's log-probs of the clean
#: completion tokens at every completion position of N = replicas * B noisy copies (row r * B + b is replica r of
#: sample b); the policy's forward (it applies the family's target alignment and the attention mask).
Score = Callable[[Tensor, Tensor, int], Tensor]


@dataclass(frozen=True)
class MaskedSequences:
    """B sampled sequences as an estimator sees them.

    prompt_ids_B_P:     prompt tokens (left padding allowed; the score function knows the attention mask).
    completion_ids_B_T: the completion block, clean.
    seed_B:             long, one mask seed per sample (from the trajectory).
    mask_id:            the model's mask token.
    step_map_B_T:       long, the sampling step at which each completion token was unmasked (``trace``), or None.
    prompt_mask_B_P:    {0, 1} real prompt tokens (only real ones are ever masked by ``p_mask_prompt``), or None.
    """

    prompt_ids_B_P: Tensor
    completion_ids_B_T: Tensor
    seed_B: Tensor
    mask_id: int
    step_map_B_T: Tensor | None = None
    prompt_mask_B_P: Tensor | None = None


@dataclass(frozen=True)
class EstimatorOptions:
    """The estimators' knobs (each reads its own; defaults are the papers')."""

    num_t: int = 2               # elbo_mc / elbo_quadrature / spg: masking times (forwards)
    p_mask_prompt: float = 0.15  # one_step: d1's prompt masking probability
    t_min: float = 0.2           # coupled: the mask ratio's range (DiffuCoder's code: U[0.2, 0.8])
    t_max: float = 0.8
    eubo_beta: float = 1.5       # spg: the EUBO's power (SPG's GSM8K runs: 1.5)
    trace_shrink: int = 1        # trace: consecutive sampling steps merged into one replayed step


@dataclass(frozen=True)
class LogProbEstimator:
    """A registered estimator: ``fn(score, seq, opts, sign_B) -> logp_B_T`` and what it costs."""

    name: str
    fn: Callable[..., Tensor]
    sampling: tuple[tuple[str, str], ...] = ()  # sampling it is exact for (``DiffusionSampling`` fields -> a rule)


LOG_PROB_ESTIMATORS: dict[str, LogProbEstimator] = {}


def register_log_prob_estimator(name: str, sampling: tuple = ()):
    """Decorator over ``fn(score, seq, opts, sign_B=None) -> logp_B_T``; ``sign_B`` (+1 / -1 per sample, or None)
    is read by estimators that choose a bound by the advantage's sign (``spg``)."""
    def add(fn):
        add_new(LOG_PROB_ESTIMATORS, name, LogProbEstimator(name, fn, sampling), "log-prob estimator")
        return fn
    return add


def get_log_prob_estimator(name: str) -> LogProbEstimator:
    return lookup(LOG_PROB_ESTIMATORS, name, "masked-diffusion log-prob estimator")


# ------------------------------------------------------------------------------------------- masks from seeds
def seeded_uniform(seed_B: Tensor, shape: tuple[int, ...], salt: int = 0) -> Tensor:
    """U[0, 1) draws [B, *shape], row b from a generator seeded with ``seed_B[b]`` (and ``salt``, one stream per
    use), on the CPU: the same for a sample whatever batch it is in, and independent of torch's global RNG."""
    out = torch.empty((len(seed_B), *shape), dtype=torch.float64)
    g = torch.Generator(device="cpu")
    for b, s in enumerate(seed_B.tolist()):
        g.manual_seed((int(s) * 1_000_003 + salt) % (2**63 - 1))
        out[b] = torch.rand(shape, generator=g, dtype=torch.float64)
    return out


def _masked(ids: Tensor, mask: Tensor, mask_id: int) -> Tensor:
    return torch.where(mask, torch.full_like(ids, mask_id), ids)


def _replicate(x: Tensor, r: int) -> Tensor:
    return x.repeat(r, *([1] * (x.dim() - 1)))


def _run(score: Score, seq: MaskedSequences, masks_R_B_T: Tensor, prompt_R_B_P: Tensor | None = None) -> Tensor:
    """Log-probs [R, B, T] of the clean completion under R masked copies (prompt clean unless given)."""
    R, B, T = masks_R_B_T.shape
    completion = _masked(_replicate(seq.completion_ids_B_T, R), masks_R_B_T.reshape(R * B, T).to(seq.completion_ids_B_T.device),
                         seq.mask_id)
    prompt = _replicate(seq.prompt_ids_B_P, R) if prompt_R_B_P is None else prompt_R_B_P.reshape(R * B, -1)
    return score(prompt, completion, R).reshape(R, B, T)


# ------------------------------------------------------------------------------------------------ estimators
@register_log_prob_estimator("one_step")
def one_step(score: Score, seq: MaskedSequences, opts: EstimatorOptions, sign_B: Tensor | None = None) -> Tensor:
    """d1: log p(x_i | prompt with p_mask_prompt of its tokens masked, completion all masked), one forward."""
    B, T = seq.completion_ids_B_T.shape
    prompt = seq.prompt_ids_B_P
    if opts.p_mask_prompt > 0 and prompt.shape[1] > 0:
        real = torch.ones_like(prompt, dtype=torch.bool) if seq.prompt_mask_B_P is None else seq.prompt_mask_B_P.bool()
        # one draw per prompt column: the same masks as long as the batch's prompt width is the one it was sampled
        # with (a trajectory keeps it through select; batches of other widths joined by Trajectory.cat move the
        # right-aligned tokens to other columns, which the trainer's ratio-1 check would report)
        drop = (seeded_uniform(seq.seed_B, (prompt.shape[1],), salt=1) < opts.p_mask_prompt).to(prompt.device) & real
        prompt = _masked(prompt, drop, seq.mask_id)
    full = torch.ones(1, B, T, dtype=torch.bool)
    return _run(score, seq, full, prompt.unsqueeze(0))[0]


@register_log_prob_estimator("coupled")
def coupled(score: Score, seq: MaskedSequences, opts: EstimatorOptions, sign_B: Tensor | None = None) -> Tensor:
    """DiffuCoder: (log p(x_i | all masked) + [m_i ? log p(x_i | x_m) / t : log p(x_i | x_~m) / (1 - t)]) / 2, with
    m masking each token with probability t ~ U[t_min, t_max] (per sample) and ~m its complement."""
    B, T = seq.completion_ids_B_T.shape
    t_B = opts.t_min + (opts.t_max - opts.t_min) * seeded_uniform(seq.seed_B, (), salt=2)
    m = seeded_uniform(seq.seed_B, (T,), salt=3) < t_B.unsqueeze(-1)
    masks = torch.stack([torch.ones_like(m), m, ~m])
    lp = _run(score, seq, masks)
    t = t_B.to(lp.device, lp.dtype).unsqueeze(-1)
    pair = torch.where(m.to(lp.device), lp[1] / t, lp[2] / (1 - t))
    return (lp[0] + pair) / 2


def _stratified_times(seq: MaskedSequences, n: int, salt: int) -> Tensor:
    """n stratified times per sample in (0, 1]: t_k = (k + u_k) / n, [B, n]."""
    u = seeded_uniform(seq.seed_B, (n,), salt=salt)
    t = (torch.arange(n, dtype=torch.float64) + u) / n
    return t.clamp(min=1e-3)


def _elbo_masks(seq: MaskedSequences, n: int) -> tuple[Tensor, Tensor]:
    """(masks [n, B, T], times [B, n]): token i masked in replica k with probability t_k."""
    T = seq.completion_ids_B_T.shape[1]
    t = _stratified_times(seq, n, salt=4)
    u = seeded_uniform(seq.seed_B, (n, T), salt=5)
    return (u < t.unsqueeze(-1)).permute(1, 0, 2), t


@register_log_prob_estimator("elbo_mc")
def elbo_mc(score: Score, seq: MaskedSequences, opts: EstimatorOptions, sign_B: Tensor | None = None) -> Tensor:
    """The ELBO's per-token terms by Monte Carlo: 1/K * sum_k 1[masked_ik] / t_k * log p(x_i | x_{t_k})."""
    masks, t = _elbo_masks(seq, opts.num_t)
    lp = _run(score, seq, masks)
    w = masks.to(lp.device, lp.dtype) / t.T.unsqueeze(-1).to(lp.device, lp.dtype)
    return (w * lp).mean(0)


def gauss_legendre_01(n: int) -> tuple[Tensor, Tensor]:
    """Gauss-Legendre nodes and weights on [0, 1] (weights sum to 1), by Golub-Welsch: the eigenvalues of the
    Legendre Jacobi matrix are the nodes on [-1, 1], twice the squared first eigenvector components the weights
    (numpy.polynomial.legendre.leggauss gives the same; algos imports torch only)."""
    k = torch.arange(1, n, dtype=torch.float64)
    jacobi = torch.diag(k / torch.sqrt(4 * k**2 - 1), 1)
    x, vec = torch.linalg.eigh(jacobi + jacobi.T)
    return (x + 1) / 2, vec[0] ** 2


@register_log_prob_estimator("elbo_quadrature")
def elbo_quadrature(score: Score, seq: MaskedSequences, opts: EstimatorOptions,
                    sign_B: Tensor | None = None) -> Tensor:
    """GDPO: sum_j w_j * T / k_j * 1[i in S_j] * log p(x_i | x_-S_j), S_j a uniformly random set of exactly
    k_j = ceil(t_j * T) tokens at the Gauss-Legendre node t_j. With f(k) = T/k * E_{|S|=k} sum_{i in S} log p, the
    ELBO is 1/T * sum_k f(k) = int_0^1 f(ceil(t T)) dt, which the nodes integrate."""
    B, T = seq.completion_ids_B_T.shape
    nodes, weights = gauss_legendre_01(opts.num_t)
    k = torch.clamp(torch.ceil(nodes * T), 1, T).long()                     # [n]
    ranks = seeded_uniform(seq.seed_B, (opts.num_t, T), salt=6).argsort(-1).argsort(-1)  # a random order per node
    masks = (ranks < k.view(1, -1, 1)).permute(1, 0, 2)                      # [n, B, T]
    lp = _run(score, seq, masks)
    scale = (weights * T / k).to(lp.device, lp.dtype).view(-1, 1, 1)
    return (scale * masks.to(lp.device, lp.dtype) * lp).sum(0)


def spg_bounds(score: Score, seq: MaskedSequences, opts: EstimatorOptions) -> tuple[Tensor, Tensor]:
    """SPG's two bounds per token from the same ``num_t`` masked forwards: (ELBO terms as ``elbo_mc``, EUBO terms
    1/beta * log(1/K * sum_k p(x_i | x_{t_k})^beta * 1[masked_ik] / t_k)); a token no replica masks gets 0 in
    the EUBO (SPG's ``loss_mask``)."""
    masks, t = _elbo_masks(seq, opts.num_t)
    lp = _run(score, seq, masks)
    m = masks.to(lp.device, lp.dtype)
    inv_t = 1 / t.T.unsqueeze(-1).to(lp.device, lp.dtype)
    elbo = (m * inv_t * lp).mean(0)
    beta = opts.eubo_beta
    # log mean_k exp(beta * lp + log(1/t)) over masked replicas, in log space (no underflow of p^beta)
    logw = torch.where(m > 0, beta * lp + torch.log(inv_t), torch.full_like(lp, -math.inf))
    avg = torch.logsumexp(logw, dim=0) - math.log(opts.num_t)
    eubo = torch.where(torch.isfinite(avg), avg / beta, torch.zeros_like(avg))
    return elbo, eubo


@register_log_prob_estimator("spg")
def spg(score: Score, seq: MaskedSequences, opts: EstimatorOptions, sign_B: Tensor | None = None) -> Tensor:
    """SPG: the ELBO where ``sign_B`` >= 0 (or is None), the EUBO where it is negative (``spg_bounds``)."""
    elbo, eubo = spg_bounds(score, seq, opts)
    if sign_B is None:
        return elbo
    return torch.where(sign_B.to(elbo.device).view(-1, 1) < 0, eubo, elbo)


def replay(score: Score, seq: MaskedSequences, order_B_T: Tensor) -> Tensor:
    """log p(x_i | tokens of a smaller ``order`` revealed, the rest masked) per token: the exact log-prob of the
    unmasking path that reveals tokens in ``order`` (ties: revealed together, each scored before the others).
    One forward per distinct order value."""
    order = order_B_T.to(torch.long).cpu()
    steps = torch.unique(order)
    masks = torch.stack([order >= s for s in steps.tolist()])               # [S, B, T]: not yet revealed at step s
    lp = _run(score, seq, masks)
    pick = torch.stack([order == s for s in steps.tolist()]).to(lp.device, lp.dtype)
    return (pick * lp).sum(0)


@register_log_prob_estimator("trace")
def trace(score: Score, seq: MaskedSequences, opts: EstimatorOptions, sign_B: Tensor | None = None) -> Tensor:
    """TraceRL: the sampler's trace replayed (``replay`` on ``step_map // trace_shrink``)."""
    if seq.step_map_B_T is None:
        raise ValueError("the 'trace' estimator replays the sampler's step_map, which this trajectory lacks")
    return replay(score, seq, torch.div(seq.step_map_B_T, opts.trace_shrink, rounding_mode="floor"))


@register_log_prob_estimator("ar_order", sampling=(("block_length", "1"), ("steps", "gen_length")))
def ar_order(score: Score, seq: MaskedSequences, opts: EstimatorOptions, sign_B: Tensor | None = None) -> Tensor:
    """JustGRPO: the exact left-to-right log-prob, token j given tokens < j (``replay`` in position order)."""
    B, T = seq.completion_ids_B_T.shape
    return replay(score, seq, torch.arange(T).expand(B, T))


def forwards_per_sequence(name: str, opts: EstimatorOptions, T: int, steps: int | None = None) -> int:
    """How many model forwards an estimator spends per sequence (``steps``: the sampler's, for ``trace``)."""
    return {"one_step": 1, "coupled": 3, "elbo_mc": opts.num_t, "elbo_quadrature": opts.num_t, "spg": opts.num_t,
            "trace": math.ceil((steps or T) / opts.trace_shrink), "ar_order": T}[name]


# ------------------------------------------------------------------- the losses of the masked-diffusion papers
def _register_losses() -> None:
    """SPG's and wd1's objectives as registered policy losses, and wd1's weights as an advantage estimator (they
    are the math of those papers; any policy whose ``log_prob`` is a likelihood estimate can train with them)."""
    from unialign.algos.advantage_estimators import _per_sequence, register_advantage
    from unialign.algos.advantages import group_advantages
    from unialign.algos.policy_loss import register_policy_loss

    @register_policy_loss("spg", inputs=("eubo",))
    def _spg(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, spec, eubo: Tensor):
        """SPG (arXiv 2510.09541; facebookresearch/SPG ``spg_trainer.py``): -A * bound, no ratio: the ELBO
        (``logp``) where A >= 0, ``spg_mix_weight`` * EUBO + (1 - weight) * ELBO where A < 0 (weight 1: SPG-EUBO, 0.5:
        SPG-Mix). ``eubo``: the policy's upper-bound terms from the same masked forwards."""
        adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        adv = adv.to(logp.dtype).expand_as(logp)
        w = spec.spg_mix_weight
        bound = torch.where(adv < 0, w * eubo + (1 - w) * logp, logp)
        loss = -adv * bound * mask
        with torch.no_grad():
            metrics = {"spg_negative_frac": (((adv < 0).to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1))}
        return loss, metrics

    @register_policy_loss("wd1")
    def _wd1(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, spec):
        """wd1 (arXiv 2507.08838; xiaohangt/wd1): the weighted likelihood -w * log pi, with the sample weights
        w = softmax(A) - softmax(-A) over its group (advantage ``wd1``); no ratio, no old or reference policy."""
        w = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        return -w.to(logp.dtype).expand_as(logp) * logp * mask, {}

    @register_advantage("wd1", uses_groups=True)
    def _wd1_weights(inputs, spec):
        """wd1's weights: within each group, softmax(A) - softmax(-A) of the group-normalised rewards A, times the
        group size (so a group's weights have the scale of its advantages)."""
        G = inputs.group_size
        a = group_advantages(inputs.rewards_B, G, spec.scale_rewards).reshape(-1, G)
        a = torch.nan_to_num(a, nan=0.0)
        w = (torch.softmax(a, -1) - torch.softmax(-a, -1)) * G
        return _per_sequence(w.reshape(-1), inputs)


_register_losses()
