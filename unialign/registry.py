"""Algorithm presets as data. The online trainer looks everything up here; it never branches on a name.

Each ``AlgoSpec`` names its parts: advantage estimator, ratio level, clip bounds, loss aggregation,
KL estimator and where the KL goes. Field names follow TRL's ``GRPOConfig`` where TRL has one
(``num_generations`` lives in the trainer config, being a batch shape, not an algorithm choice).
Modality-dependent numbers (DDPO clips at 1e-4 on mean-reduced image log-probs; text PPO at 0.2)
live here and in script presets, never in the math's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class AlgoSpec:
    name: str
    advantage: str = "group"            # a registered estimator (algos.ADVANTAGE_ESTIMATORS): group | rloo |
                                        # per_prompt | gae | reward (raw, no baseline) | reinforce_pp
    scale_rewards: str = "group"        # TRL: group | batch | none (for advantage="group")
    importance_sampling_level: str = "token"  # TRL; token | sequence (GSPO) | sequence_token (GSPO-token)
    epsilon: float = 0.2                # TRL; lower clip bound
    epsilon_high: float | None = None   # TRL; upper clip bound (DAPO clip-higher); None = epsilon
    dual_clip: float | None = None      # verl clip_ratio_c
    loss_type: str = "seq_mean_token_mean"  # aggregation mode (TRL loss_type aliases accepted)
    beta: float = 0.0                   # TRL; KL coefficient
    kl_estimator: str = "k3"
    kl_in_reward: bool = False          # False: beta*KL added to the loss; True: -beta*KL_t in the reward (PPO)
    kl_target: float | None = None      # adaptive KL controller target (kl_in_reward only)
    kl_horizon: int = 10000
    dynamic_sampling: bool = False      # DAPO: drop zero-variance groups, refill up to max_generation_rounds
    overlong_cache_len: float = 0       # DAPO soft overlong buffer L_cache: tokens if >= 1, else a fraction of
                                        # max_completion_length (DAPO: 4096 of 20480 = 0.2); 0 = off
    mask_truncated_completions: bool = False  # TRL
    num_iterations: int = 1             # TRL; optimisation epochs per batch of samples
    advantage_clip: float | None = None  # DDPO clips advantages to +-5
    whiten_advantages: bool = False     # PPO: masked whitening of GAE advantages
    whiten_rewards: bool = False        # PPO: masked whitening (mean kept) of the KL-shaped token rewards
    gamma: float = 1.0
    lam: float = 0.95
    value_coef: float = 0.0             # > 0 trains a value head (PPO)
    value_clip: float | None = 0.2
    entropy_coef: float = 0.0
    stat_buffer_size: int = 32          # DDPO per-prompt tracker
    stat_min_count: int = 16

    def with_overrides(self, **kw) -> AlgoSpec:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


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
    "ddpo": AlgoSpec("ddpo", advantage="per_prompt", loss_type="token_mean", epsilon=1e-4, advantage_clip=5.0),
}


def get_algorithm(name: str, **overrides) -> AlgoSpec:
    """The preset ``name`` with any non-None ``overrides`` applied (TRL knob names)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name].with_overrides(**overrides)
