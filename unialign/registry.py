"""Algorithm presets as data. The online trainer looks everything up here; it never branches on a name.

Each ``AlgoSpec`` names its parts: advantage estimator, ratio level, clip bounds, loss aggregation,
KL estimator and where the KL goes. Field names follow TRL's ``GRPOConfig`` where TRL has one
(``num_generations`` lives in the trainer config, being a batch shape, not an algorithm choice).
Modality-dependent numbers (DDPO clips at 1e-4 on mean-reduced image log-probs; text PPO at 0.2)
live here and in script presets, never in the math's defaults. ``AlgoOverrides`` holds the same knobs as
optional fields, each with its help line and rules: every online config inherits them as its flags.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from unialign.config import arg


def _estimators() -> tuple[str, ...]:
    from unialign.algos.advantage_estimators import ADVANTAGE_ESTIMATORS

    return tuple(ADVANTAGE_ESTIMATORS)


def _policy_losses() -> tuple[str, ...]:
    from unialign.algos.policy_loss import POLICY_LOSSES

    return tuple(POLICY_LOSSES)


def _aggregations() -> tuple[str, ...]:
    from unialign.algos.aggregate import AGGREGATION_ALIASES

    return tuple(AGGREGATION_ALIASES)


def _log_prob_estimators() -> tuple[str, ...]:
    from unialign.algos.masked_diffusion import LOG_PROB_ESTIMATORS

    return ("sampler", "forward", *LOG_PROB_ESTIMATORS)


def _kl_estimators() -> tuple[str, ...]:
    from unialign.algos.kl import CLOSED_FORM_ESTIMATORS, KL_ALIASES

    return (*KL_ALIASES, *CLOSED_FORM_ESTIMATORS)


@dataclass(frozen=True)
class AlgoSpec:
    """One algorithm's choices. ``name`` and ``modalities`` say what the preset is (``FACTS``); every other field is a
    knob, its default the value a preset leaves unset; what each means, its bounds and its flag: ``AlgoOverrides``
    (the same fields, one for one)."""

    name: str
    # what the preset is published for: "text" (token policies: LMs, VLMs) and / or "image" (denoisers). A script
    # offers the presets of its modality (``algorithms_for``); the math itself never reads this.
    modalities: tuple[str, ...] = ("text", "image")
    advantage: str = "group"
    policy_loss: str = "clipped"
    scale_rewards: str = "group"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    dual_clip: float | None = None
    loss_type: str = "seq_mean_token_mean"
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    kl_target: float | None = None
    kl_horizon: int = 10000
    dynamic_sampling: bool = False
    overlong_cache_len: float = 0
    mask_truncated_completions: bool = False
    num_iterations: int = 1
    advantage_clip: float | None = None
    whiten_advantages: bool = False
    whiten_rewards: bool = False
    gamma: float = 1.0
    lam: float = 0.95
    value_coef: float = 0.0
    value_clip: float | None = 0.2
    entropy_coef: float = 0.0
    stat_buffer_size: int = 32
    stat_min_count: int = 16
    log_prob_estimator: str = "sampler"
    advantage_scale: float = 1.0
    nft_beta: float = 1.0
    spg_mix_weight: float = 0.5
    dgpo_beta: float = 100.0
    kl_mask_threshold: float = 1e-5
    ema_beta: float = 0.0

    def with_overrides(self, **kw) -> AlgoSpec:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


@dataclass
class AlgoOverrides:
    """The knobs of ``AlgoSpec`` as overrides, one field each (same name, its type or None): left None, a knob takes
    the preset's value. ``OnlineConfig`` inherits them, so each is a ``--flag`` and a YAML key with this help line
    and these rules (the names of registered parts are read from their registries when checked)."""

    advantage: str | None = arg(None, "advantage estimator (registered in unialign.algos.advantage_estimators) (unset: the "
                                "algorithm's)", group="algorithm", choices=_estimators)
    policy_loss: str | None = arg(None, "policy loss (registered in unialign.algos.policy_loss) (unset: the "
                                  "algorithm's)", group="algorithm", choices=_policy_losses)
    scale_rewards: str | None = arg(None, "group advantages divided by the group's std, the batch's, or none (TRL) "
                                    "(unset: the algorithm's)", group="algorithm", choices=("group", "batch", "none"))
    importance_sampling_level: str | None = arg(
        None, "importance ratio per token, per sequence (GSPO) or sequence_token (unset: the algorithm's)",
        group="algorithm", choices=("token", "sequence", "sequence_token"))
    epsilon: float | None = arg(None, "lower clip bound of the ratio (TRL epsilon) (unset: the algorithm's)",
                                group="algorithm", gt=0.0)
    epsilon_high: float | None = arg(None, "upper clip bound (DAPO clip-higher); unset: epsilon (unset: the "
                                     "algorithm's)", group="algorithm", gt=0.0)
    dual_clip: float | None = arg(None, "dual-clip bound c > 1 for negative advantages (verl clip_ratio_c) (unset: "
                                  "the algorithm's)", group="algorithm", gt=1.0)
    loss_type: str | None = arg(None, "loss aggregation over tokens and samples (TRL names accepted: grpo, dapo, "
                                "dr_grpo, bnpo, ...) (unset: the algorithm's)", group="algorithm", choices=_aggregations)
    beta: float | None = arg(None, "KL coefficient to the reference policy (0: no reference model) (unset: the "
                             "algorithm's)", group="algorithm", min=0.0)
    kl_estimator: str | None = arg(None, "KL estimator: k1, k2, k3, or gaussian (closed form, diffusion steps) (unset: "
                                   "the algorithm's)", group="algorithm", choices=_kl_estimators)
    kl_in_reward: bool | None = arg(None, "put -beta * KL_t into the per-step rewards (PPO, REINFORCE++) instead of "
                                    "beta * KL into the loss (unset: the algorithm's)", group="algorithm")
    kl_target: float | None = arg(None, "adaptive KL controller target (KL in the reward only; unset: fixed beta) "
                                  "(unset: the algorithm's)", group="algorithm", gt=0.0)
    kl_horizon: int | None = arg(None, "adaptive KL controller horizon (unset: the algorithm's)", group="algorithm",
                                 min=1)
    dynamic_sampling: bool | None = arg(None, "DAPO: drop groups whose rewards are all equal and sample again (unset: "
                                        "the algorithm's)", group="algorithm")
    overlong_cache_len: float | None = arg(
        None, "DAPO soft overlong buffer: tokens if >= 1, else a share of max_completion_length (DAPO: 4096 of 20480 "
        "= 0.2); 0: off (unset: the algorithm's)", group="algorithm", min=0.0)
    mask_truncated_completions: bool | None = arg(None, "leave completions cut at the length limit out of the loss "
                                                  "(unset: the algorithm's)", group="algorithm")
    num_iterations: int | None = arg(None, "optimisation epochs over each batch of samples (unset: the algorithm's)",
                                     group="algorithm", min=1)
    advantage_clip: float | None = arg(None, "clip advantages to +-this (DDPO: 5) (unset: the algorithm's)",
                                       group="algorithm", gt=0.0)
    whiten_advantages: bool | None = arg(None, "PPO: masked whitening of the GAE advantages (unset: the "
                                         "algorithm's)", group="algorithm")
    whiten_rewards: bool | None = arg(None, "PPO: whiten the KL-shaped token rewards (scale only, the mean kept) "
                                      "(unset: the algorithm's)", group="algorithm")
    gamma: float | None = arg(None, "discount of the per-step returns (GAE, REINFORCE++) (unset: the algorithm's)",
                              group="algorithm", min=0.0, max=1.0)
    lam: float | None = arg(None, "GAE lambda (unset: the algorithm's)", group="algorithm", min=0.0, max=1.0)
    value_coef: float | None = arg(None, "value-loss weight (> 0 trains the critic: PPO) (unset: the algorithm's)",
                                   group="algorithm", min=0.0)
    value_clip: float | None = arg(None, "clip range of the value update around the old values (unset: the "
                                   "algorithm's)", group="algorithm", gt=0.0)
    entropy_coef: float | None = arg(None, "entropy bonus weight (unset: the algorithm's)", group="algorithm")
    stat_buffer_size: int | None = arg(None, "DDPO per-prompt reward tracker: rewards kept per prompt (unset: the "
                                       "algorithm's)", group="algorithm", min=1)
    stat_min_count: int | None = arg(None, "DDPO tracker: below this many, the batch's statistics are used (unset: "
                                     "the algorithm's)", group="algorithm", min=1)
    log_prob_estimator: str | None = arg(
        None, "what the policy's log-prob estimates: the sampler's own step density (text tokens; DDPO's / "
        "Flow-GRPO's steps), the forward-process matching surrogate at fresh noise (AWM, DiffusionNFT; denoisers), or "
        "a masked-diffusion LM's estimator (unialign.algos.masked_diffusion: one_step, coupled, elbo_mc, "
        "elbo_quadrature, spg, trace, ar_order) (unset: the algorithm's)", group="algorithm",
        choices=_log_prob_estimators)
    advantage_scale: float | None = arg(None, "multiply the (clipped) advantages by this (AWM: 1/5 after clipping to "
                                        "+-5) (unset: the algorithm's)", group="algorithm", gt=0.0)
    nft_beta: float | None = arg(None, "DiffusionNFT: strength of the implicit positive / negative policies (its OCR "
                                 "runs: 0.1) (unset: the algorithm's)", group="algorithm", gt=0.0)
    spg_mix_weight: float | None = arg(None, "SPG: the EUBO's share in the bound of negative-advantage samples (1: "
                                       "SPG-EUBO, 0.5: SPG-Mix) (unset: the algorithm's)", group="algorithm",
                                       min=0.0, max=1.0)
    dgpo_beta: float | None = arg(None, "DGPO: the DPO temperature of its group score s_g = beta / G sum_g A (err - "
                                  "err_ref) (its GenEval runs: 100) (unset: the algorithm's)", group="algorithm", gt=0.0)
    kl_mask_threshold: float | None = arg(None, "Flow-DPPO: a step whose exact Gaussian KL to the sampling step reaches "
                                          "this and whose ratio moves with its advantage is dropped (verl-omni: 1e-5) "
                                          "(unset: the algorithm's)", group="algorithm", gt=0.0)
    ema_beta: float | None = arg(None, "forward process: weight of the trust term mean (pred - pred_old)^2 to the old "
                                 "policy, a moving average of the trained weights (AWM: 1) (unset: the algorithm's)",
                                 group="algorithm", min=0.0)


KNOBS = tuple(f.name for f in fields(AlgoOverrides))  # the names of AlgoSpec's knobs
FACTS = ("name", "modalities")  # AlgoSpec's other fields: what a preset is, not a knob
# Presets published for masked-diffusion LMs (their log_prob_estimator names a masked-diffusion estimator; a causal
# LM is refused by the trainer's estimator check): text, like every token policy.
DLM = ("text",)
# Presets published for denoisers only: their clip ranges, per-step statistics and closed-form step KLs are tuned
# on diffusion sampling steps, or they need the forward-process estimate.
IMAGE = ("image",)


ALGORITHMS: dict[str, AlgoSpec] = {
    # GRPO (Shao et al. 2024): group-normalised outcome advantages, per-sequence token mean, k3 in the loss.
    "grpo": AlgoSpec("grpo", beta=0.04),
    # DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic sampling, soft overlong punishment, no KL.
    # The overlong buffer is the paper's share of the length limit, so the penalty starts where the paper's
    # does relative to it (a fixed token count would be a hard cut at 20k tokens or hit answers at 30).
    "dapo": AlgoSpec("dapo", epsilon=0.2, epsilon_high=0.28, loss_type="token_mean", dynamic_sampling=True,
                     overlong_cache_len=0.2),
    # Dr.GRPO (Liu et al. 2025): no std scaling, no length normalisation (constant B*T_max).
    "dr_grpo": AlgoSpec("dr_grpo", scale_rewards="none", loss_type="seq_mean_token_sum_norm"),
    # GSPO (Zheng et al. 2025): sequence-level ratio, tiny clip range (3e-4 / 4e-4), sequence mean.
    "gspo": AlgoSpec("gspo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    "gspo_token": AlgoSpec("gspo_token", importance_sampling_level="sequence_token", epsilon=3e-4, epsilon_high=4e-4),
    # REINFORCE with the raw sequence reward; RLOO with the leave-one-out baseline.
    "reinforce": AlgoSpec("reinforce", advantage="reward", loss_type="seq_mean_token_sum"),
    "rloo": AlgoSpec("rloo", advantage="rloo", loss_type="seq_mean_token_sum"),
    # REINFORCE++ (Hu 2025; OpenRLHF's defaults): k1 KL in the token rewards (beta 0.01), returns with gamma 1,
    # advantages whitened over the global batch; PPO clip 0.2, token-mean loss; no critic, no groups.
    "reinforce_pp": AlgoSpec("reinforce_pp", advantage="reinforce_pp", loss_type="token_mean", beta=0.01,
                             kl_estimator="k1", kl_in_reward=True, gamma=1.0),
    # PPO-RLHF (Ouyang et al. 2022): GAE on a value head, k1 KL in the reward, whitened advantages.
    "ppo": AlgoSpec("ppo", advantage="gae", loss_type="token_mean", beta=0.05, kl_estimator="k1", kl_in_reward=True,
                    whiten_advantages=True, value_coef=0.1, value_clip=0.2, num_iterations=2, gamma=1.0, lam=0.95),
    # DDPO (Black et al. 2023): per-step PPO clip at 1e-4 on mean-reduced log-probs, per-prompt stat tracking,
    # advantages clipped to +-5, no KL; every trained denoising step weighted equally.
    "ddpo": AlgoSpec("ddpo", IMAGE, advantage="per_prompt", loss_type="token_mean", epsilon=1e-4, advantage_clip=5.0),
    # Flow-GRPO (Liu et al. 2025, arXiv 2505.05470; yifan123/flow_grpo config/grpo.py, scripts/train_sd3.py): per-step
    # PPO clip at 1e-4 on mean-reduced SDE-step log-probs, advantages clipped to +-5; per-prompt statistics within
    # the current batch (its tracker is cleared every epoch = each prompt's group of G) divided by the std of the
    # whole batch (``sample.global_std``); the closed-form Gaussian KL to the reference (adapters off) in the loss
    # at beta 0.04 (GenEval / OCR) in Flow-GRPO's own convention, "gaussian_g2": its code divides the squared mean
    # gap by the diffusion coefficient g^2, not by the step variance g^2 |dt|, so its KL is the exact step KL
    # ("gaussian") times |dt| -- about 10x weaker at 10 steps; beta 0.04 on the exact KL would regularise ~10x
    # harder than the paper (tests/image/test_kl.py works the example). Every trained step weighted equally. The
    # SDE noise level (0.7) and the group size are the policy's and the script's (``--noise_level``,
    # ``--num_generations``).
    "flow_grpo": AlgoSpec("flow_grpo", IMAGE, advantage="group", scale_rewards="batch", loss_type="token_mean", epsilon=1e-4,
                          advantage_clip=5.0, beta=0.04, kl_estimator="gaussian_g2"),
    # Pref-GRPO (Wang et al. 2025, arXiv 2508.20751; CodeGoat24/Pref-GRPO, built on Flow-GRPO): Flow-GRPO with each
    # reward replaced by its win rate within the group before the normalisation (``win_rate``), so tiny score gaps
    # are not blown up into full advantages. Its pairwise judge (UnifiedReward-Think) is a reward of two images:
    # ``unialign.rewards.pairwise`` gives the win rates as the reward (then the plain group advantage suffices).
    "pref_grpo": AlgoSpec("pref_grpo", IMAGE, advantage="win_rate", scale_rewards="batch", loss_type="token_mean",
                          epsilon=1e-4, advantage_clip=5.0, beta=0.04, kl_estimator="gaussian_g2"),
    # AWM, Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050; scxue/advantage_weighted_matching
    # scripts/train_sd3_awm.py, config/dgx_awm.py GenEval): the PPO-clip loss per pair ("exp_first") on the
    # forward-process matching log-prob (its weighting, ghuber p 0.25, is the policy's: unialign.recipes.image
    # FORWARD_PROCESS), clip range 1 (inactive at one optimizer step per batch, where the ratio is 1, as in the
    # paper's configs), per-prompt means over the batch's std, advantages clipped to +-5 then divided by 5, the
    # "uniform velocity KL" mean (v - v_ref)^2 at beta 0.001 (GenEval; OCR 0.003, PickScore 1e-4), mean over pairs,
    # and its second trust term, ema_beta 1 x mean (v - v_old)^2 to a moving average of the LoRA decayed by
    # min(0.3, 0.001 step) (config/dgx_awm.py kl_ema_*: "Uniform", linear; the policy's old policy: FORWARD_PROCESS).
    "awm": AlgoSpec("awm", IMAGE, advantage="group", scale_rewards="batch", loss_type="token_mean", epsilon=1.0,
                    advantage_clip=5.0, advantage_scale=0.2, beta=0.001, kl_estimator="prediction_mse",
                    log_prob_estimator="forward", ema_beta=1.0),
    # DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117, ICLR 2026; NVlabs/DiffusionNFT scripts/train_nft_sd3.py,
    # config/nft.py): the NFT loss with r = clip(A, -5, 5) / 5 / 2 + 1/2 and beta 1 (OCR 0.1), times A_max as the
    # code scales it, no ratio; per-prompt means over the batch's std; the velocity MSE to the reference at 1e-4;
    # the old policy (a moving average of the trained one, min(0.001 step, 0.5)) collects the samples and anchors
    # the implicit policies (the policy's side: unialign.recipes.image FORWARD_PROCESS).
    "nft": AlgoSpec("nft", IMAGE, advantage="group", scale_rewards="batch", loss_type="token_mean", policy_loss="nft",
                    advantage_clip=5.0, beta=1e-4, kl_estimator="prediction_mse", log_prob_estimator="forward",
                    nft_beta=1.0),
    # DGPO (Luo, Hu & Tang, ICLR 2026, arXiv 2510.08425; Luo-Yihong/DGPO scripts/train_sd3_dgpo.py, config/
    # dgpo_wocfg.py geneval_sd3_4gpu): group-level DPO on the forward process (``unialign.algos.forward.dgpo_loss``)
    # with beta_dpo 100 on the plain velocity MSE (weighting "uniform"), CFG-free collection by a deterministic
    # solver, K = 4 pairs shared by each group from the noisiest half of the steps (FORWARD_PROCESS), PPO's clip at
    # 1e-3 on exp(err_old - err) against the old policy (a moving average decayed by min(0.3, 0.001 step)), group
    # advantages (per-prompt std: global_std False) clipped to +-5, the velocity KL mean (v - v_ref)^2 at beta 0.02.
    # Left out: its reference with CFG 4.5 (kl_cfg; the embedded world samples CFG-free), its sampling from the
    # old policy after step 500 (switch_ema_ref).
    "dgpo": AlgoSpec("dgpo", IMAGE, advantage="group", scale_rewards="group", loss_type="token_mean",
                     policy_loss="dgpo", epsilon=1e-3, advantage_clip=5.0, beta=0.02, kl_estimator="prediction_mse",
                     log_prob_estimator="forward", dgpo_beta=100.0),
    # GRPO-Guard (arXiv 2510.22319; verl-project/verl-omni GRPOGuardLoss, examples/grpoguard_trainer): Flow-GRPO's SDE
    # steps with RatioNorm (the log-ratio's mean shift removed, its scale the step's std) and each step's loss
    # weighted by 1 / |dt|; clip 2e-6 on the normalised ratio, advantages clipped to +-5, no KL (verl-omni's example);
    # per-prompt means over the batch's std as Flow-GRPO.
    "grpo_guard": AlgoSpec("grpo_guard", IMAGE, advantage="group", scale_rewards="batch", loss_type="token_mean",
                           policy_loss="grpo_guard", epsilon=2e-6, advantage_clip=5.0),
    # Flow-DPPO (arXiv 2606.11025; Tencent-Hunyuan/UniRL flowdppo.py, verl-omni FlowDPPOLoss): -A rho on Flow-GRPO's SDE
    # steps without a clip; a step whose exact Gaussian KL to the sampling step reaches 1e-5 and whose ratio moves
    # with its advantage is dropped; advantages as Flow-GRPO's, no KL (verl-omni's example).
    "flow_dppo": AlgoSpec("flow_dppo", IMAGE, advantage="group", scale_rewards="batch", loss_type="token_mean",
                          policy_loss="flow_dppo", advantage_clip=5.0, kl_mask_threshold=1e-5),
    # ---- masked-diffusion LMs (unialign.dlm; the estimators: unialign.algos.masked_diffusion)
    # diffu-GRPO (d1, Zhao et al. 2025, arXiv 2504.12216; dllm-reasoning/d1): GRPO with the one-step estimate (the
    # completion masked, prompt tokens at p 0.15), mu = 12 inner iterations on one batch, beta 0.04, clip 0.2. d1
    # draws new prompt masks each inner iteration; here each sample keeps its masks (its seed) for the whole update.
    "diffu_grpo": AlgoSpec("diffu_grpo", DLM, beta=0.04, num_iterations=12, log_prob_estimator="one_step"),
    # coupled-GRPO (DiffuCoder, arXiv 2506.20639; apple/ml-diffucoder): GRPO on the coupled complementary-mask
    # estimate, no KL (its recipe's beta 0), token-mean loss, 2 inner iterations.
    "coupled_grpo": AlgoSpec("coupled_grpo", DLM, loss_type="token_mean", num_iterations=2,
                             log_prob_estimator="coupled"),
    # GDPO (ICLR 2026; NVIDIA-NeMo/RL research/gdpo): the ELBO by Gauss-Legendre quadrature with stratified exact-k
    # masks, a sequence-level length-normalised ratio (GSPO's form) clipped at 0.2, group advantages.
    "gdpo": AlgoSpec("gdpo", DLM, importance_sampling_level="sequence", log_prob_estimator="elbo_quadrature"),
    # TraceRL (Gen-Verse/dLLM-RL train/rl_sdar.py): PPO clip on the sampler's replayed trace, 2 inner iterations
    # (its KL to the old policy is the clip's here), token-mean loss.
    "trace_rl": AlgoSpec("trace_rl", DLM, loss_type="token_mean", num_iterations=2, log_prob_estimator="trace"),
    # SPG (arXiv 2510.09541; facebookresearch/SPG): -A * (ELBO, or the EUBO mixed in for A < 0), no ratio; GSM8K:
    # SPG-Mix, beta 1.5 (the policy's --eubo_beta), weight 0.5; token-mean over the batch.
    "spg": AlgoSpec("spg", DLM, policy_loss="spg", loss_type="token_mean", log_prob_estimator="spg",
                    spg_mix_weight=0.5),
    # wd1 (arXiv 2507.08838; xiaohangt/wd1): the weighted likelihood with softmax(+-A) group weights on d1's
    # one-step estimate; no ratio, no reference.
    "wd1": AlgoSpec("wd1", DLM, advantage="wd1", policy_loss="wd1", loss_type="token_mean",
                    log_prob_estimator="one_step"),
    # JustGRPO (ICML 2026; LeapLabTHU/JustGRPO): plain GRPO on the exact left-to-right log-prob, rollouts sampled in
    # that order (block length 1: the estimator's sampling fact).
    "just_grpo": AlgoSpec("just_grpo", DLM, log_prob_estimator="ar_order"),
}


def algorithms_for(modality: str) -> tuple[str, ...]:
    """The presets published for ``modality`` ("text" or "image"), in the registry's order: a script's choices."""
    return tuple(name for name, spec in ALGORITHMS.items() if modality in spec.modalities)


def diffusion_preset_refused(value: str, choices: tuple) -> str | None:
    """The refusal of a denoiser's preset by a text script (an ``--algorithm`` field's ``hint``, see
    ``unialign.config``), or None for any other value."""
    if value not in ALGORITHMS or "text" in ALGORITHMS[value].modalities:
        return None
    return (f"{value!r} is a preset for diffusion models (scripts/grpo_image.py, scripts/ddpo_aesthetic.py); "
            f"this script's: {', '.join(map(str, choices))}")


def get_algorithm(name: str, **overrides) -> AlgoSpec:
    """The preset ``name`` with any non-None ``overrides`` applied (TRL knob names)."""
    if name not in ALGORITHMS:
        from unialign.errors import did_you_mean

        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}{did_you_mean(name, ALGORITHMS)}")
    return ALGORITHMS[name].with_overrides(**overrides)
