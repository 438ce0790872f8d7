"""Forward-process RL for denoisers: a sample is scored on the model's own pre-training loss at fresh noise,
no sampler log-density needed (Advantage Weighted Matching, DiffusionNFT).

With x0 a sample's clean latent, eps ~ N(0, I) and x_t = alpha_t x0 + sigma_t eps the forward process at the
pair's time t, the denoiser's prediction ``pred`` regresses a ``target`` (eps - x0 for rectified-flow
velocity models, eps for epsilon-prediction UNets). Pure functions of tensors, float64 inside:

    matching_logprob(pred_B_D, target_B_D, t_B, weighting, power) -> logp_B
        AWM's log-prob surrogate (Xue et al. 2025, arXiv 2509.25050; scxue/advantage_weighted_matching
        ``scripts/train_sd3_awm.py`` ``compute_log_prob_awm``), m = mean_D (pred - target)^2:
            uniform  -m            t   -m t            t2  -m t^2
            ghuber   -((m + 1e-10)^p - (1e-10)^p) t / p     (AWM's default, p = 0.25)
        The PPO-clip policy loss on this log-prob, per pair ("exp_first") or of the mean over a sample's
        pairs ("sum_first", GSPO's sequence ratio), is AWM; at ratio 1 its gradient is the advantage-weighted
        flow-matching loss's.
    nft_weight(advantages_B, adv_clip_max) -> r_B
        DiffusionNFT's optimality weight (Zheng et al. 2025, arXiv 2509.16117; NVlabs/DiffusionNFT
        ``scripts/train_nft_sd3.py``): r = clip(A, -A_max, A_max) / A_max / 2 + 1/2, in [0, 1].
    nft_loss(v_B_D, v_old_B_D, x0_B_D, xt_B_D, sigma_B, r_B, beta) -> loss_B
        the implicit positive and negative policies around the old one, v+ = beta v + (1 - beta) v_old,
        v- = (1 + beta) v_old - beta v, their clean-image estimates x0^+- = x_t - sigma v^+- (velocity
        models), the adaptive weights w+- = max(mean_D |x0^+- - x0|, 1e-5) (no gradient), and
            loss = (r mean_D (x0^+ - x0)^2 / w+ + (1 - r) mean_D (x0^- - x0)^2 / w-) / beta
        with no gradient through v_old. ``nft_loss_terms`` is the same in clean-image space for any prediction
        affine in the model output (an epsilon model's x0 = (x_t - sigma eps) / alpha mixes the same way).
    dgpo_loss(err, ref_err, advantages, group_size, beta, old_err, clip_range) -> loss (err's shape)
        DGPO's group-level DPO on forward-process likelihoods (Luo, Hu & Tang, ICLR 2026, arXiv 2510.08425;
        Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py``): with err / ref_err the policy's and the reference's matching
        errors at the same (t, eps), per group g of ``group_size`` contiguous samples (and per shared timestep k)
            s_g = beta / G  sum_{i in g} A_i (err_i - ref_i)        (the partition function cancels: sum_g A = 0)
            loss_i = sg[sigmoid(s_g)] A_i err_i
        whose gradient is (G / beta) x that of sum_g softplus(s_g); with ``old_err`` and ``clip_range`` eps,
        rho = exp(old_err - err) and err is held (no gradient) where (A > 0 and rho > 1 + eps) or (A <= 0 and
        rho < 1 - eps), PPO's clip on the likelihood ratio.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

WEIGHTINGS = ("uniform", "t", "t2", "ghuber")
_GHUBER_EPS = 1e-10
NFT_MIN_WEIGHT = 1e-5


def _mean_D(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], -1).mean(dim=1)


def matching_logprob(pred_B_D: Tensor, target_B_D: Tensor, t_B: Tensor, weighting: str = "uniform",
                     power: float = 0.25) -> Tensor:
    """AWM's weighted matching log-prob [B] (module docstring): m = mean over every non-batch dim of
    (pred - target)^2, computed in float64, then weighted by the pair's time t [B] (the noise level: sigma for
    rectified flow, in [0, 1]). Differentiable in ``pred``; returns float32."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    m = _mean_D((pred_B_D.double() - target_B_D.double()) ** 2)
    t = t_B.to(m.device, torch.float64).reshape(-1)
    if weighting == "uniform":
        logp = -m
    elif weighting == "t":
        logp = -m * t
    elif weighting == "t2":
        logp = -m * t**2
    else:
        if power <= 0:
            raise ValueError(f"ghuber power must be > 0, got {power}")
        logp = -((m + _GHUBER_EPS) ** power - _GHUBER_EPS**power) * t / power
    return logp.float()


def nft_weight(advantages_B: Tensor, adv_clip_max: float) -> Tensor:
    """DiffusionNFT's r = clip(A, -A_max, A_max) / A_max / 2 + 1/2 [B] (0: surely bad, 1/2: no signal, 1: surely
    good)."""
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    return (advantages_B.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max / 2 + 0.5).clamp(0.0, 1.0)


def nft_loss_terms(old_err_B_D: Tensor, delta_B_D: Tensor, r_B: Tensor, beta: float) -> Tensor:
    """DiffusionNFT's loss [B] in the clean-image space of any prediction that is affine in the model output:
    ``old_err`` = x0_old - x0 (the old policy's estimate's error, no gradient), ``delta`` = x0_theta - x0_old (the
    trained policy's estimate minus the old one's). The implicit policies' estimates are x0^+ - x0 = old_err +
    beta delta and x0^- - x0 = old_err - beta delta (x0^+- of v^+- = beta v + (1 - beta) v_old and (1 + beta) v_old
    - beta v); each squared error (mean_D) is divided by its own adaptive weight max(mean_D |x0^+- - x0|, 1e-5),
    without gradient; loss = (r e+ + (1 - r) e-) / beta. Float64 inside, float32 out."""
    if beta <= 0:
        raise ValueError(f"NFT beta must be > 0, got {beta}")
    old, delta = old_err_B_D.detach().double(), delta_B_D.double()
    errors = []
    for sign in (1.0, -1.0):
        err = old + sign * beta * delta
        with torch.no_grad():
            w = _mean_D(err.abs()).clamp(min=NFT_MIN_WEIGHT)
        errors.append(_mean_D(err**2) / w)
    r = r_B.to(old.device, torch.float64).reshape(-1)
    return ((r * errors[0] + (1 - r) * errors[1]) / beta).float()


def nft_loss(v_B_D: Tensor, v_old_B_D: Tensor, x0_B_D: Tensor, xt_B_D: Tensor, sigma_B: Tensor, r_B: Tensor,
             beta: float) -> Tensor:
    """DiffusionNFT's loss [B] for a velocity model at x_t = (1 - sigma) x0 + sigma eps (module docstring), with
    x0^+- = x_t - sigma v^+-: ``nft_loss_terms`` with old_err = x_t - sigma v_old - x0, delta = -sigma (v - v_old)."""
    sigma = sigma_B.to(xt_B_D.device, torch.float64).reshape(-1, *([1] * (xt_B_D.dim() - 1)))
    v_old = v_old_B_D.detach().double()
    old_err = xt_B_D.double() - sigma * v_old - x0_B_D.double()
    return nft_loss_terms(old_err, -sigma * (v_B_D.double() - v_old), r_B, beta)


def dgpo_loss(err: Tensor, ref_err: Tensor, advantages: Tensor, group_size: int, beta: float,
              old_err: Tensor | None = None, clip_range: float | None = None) -> Tensor:
    """DGPO's per-sample surrogate (module docstring). ``err``, ``ref_err`` (and ``old_err``): [B] or [B, K] matching
    errors mean_D (pred - target)^2, K timesteps shared within each group; ``advantages`` [B], groups of
    ``group_size`` contiguous samples (B a multiple of it). Returns the loss, ``err``'s shape (sum or mean it)."""
    B = err.shape[0]
    if group_size < 1 or B % group_size:
        raise ValueError(f"dgpo_loss: {B} samples are not whole groups of {group_size}")
    A = advantages.reshape(B, *([1] * (err.dim() - 1))).to(err.dtype)
    gap = (A * (err - ref_err)).detach().reshape(B // group_size, group_size, *err.shape[1:])
    weight = torch.sigmoid(beta / group_size * gap.sum(1)).repeat_interleave(group_size, dim=0)
    trained = err
    if old_err is not None and clip_range is not None:
        rho = torch.exp(old_err.to(err.dtype) - err).detach()
        held = ((A > 0) & (rho > 1 + clip_range)) | ((A <= 0) & (rho < 1 - clip_range))
        trained = torch.where(held, err.detach(), err)
    return weight * A * trained
