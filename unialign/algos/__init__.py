"""Pure math of every alignment method unialign runs: tensors in, tensors out; imports torch only."""

from unialign.algos.advantage_estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutput,
    discounted_returns,
    get_estimator,
    global_whiten,
    register_advantage,
)
from unialign.algos.advantages import (
    PerPromptStatTracker,
    gae,
    group_advantages,
    rloo_advantages,
    whiten,
)
from unialign.algos.aggregate import aggregate, local_normalizer
from unialign.algos.importance_sampling import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    rollout_correction,
)
from unialign.algos.kl import (
    CLOSED_FORM_ESTIMATORS,
    NEEDS_KL_WEIGHTS,
    check_kl_estimator,
    closed_form_kl,
    gaussian_kl,
    kl_estimate,
)
from unialign.algos.masked_diffusion import (
    LOG_PROB_ESTIMATORS,
    EstimatorOptions,
    MaskedSequences,
    get_log_prob_estimator,
    register_log_prob_estimator,
    spg_bounds,
)
from unialign.algos.pair_losses import (
    PAIR_LOSSES,
    PairLoss,
    chosen_nll_loss,
    get_pair_loss,
    orpo_odds_ratio_loss,
    register_pair_loss,
    simpo_loss,
)
from unialign.algos.policy_loss import (
    POLICY_LOSSES,
    clipped_policy_loss,
    get_policy_loss,
    register_policy_loss,
    sequence_log_ratio,
)
from unialign.algos.preference import bradley_terry_loss, dpo_loss
from unialign.algos.shaping import AdaptiveKLController, kl_shaped_rewards, overlong_penalty
from unialign.algos.value import clipped_value_loss, entropy_from_logits

__all__ = [
    "LOG_PROB_ESTIMATORS",
    "EstimatorOptions",
    "MaskedSequences",
    "get_log_prob_estimator",
    "register_log_prob_estimator",
    "spg_bounds",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageInputs",
    "AdvantageOutput",
    "discounted_returns",
    "get_estimator",
    "global_whiten",
    "register_advantage",
    "CLOSED_FORM_ESTIMATORS",
    "NEEDS_KL_WEIGHTS",
    "PAIR_LOSSES",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "AdaptiveKLController",
    "PairLoss",
    "PerPromptStatTracker",
    "aggregate",
    "bradley_terry_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "dpo_loss",
    "entropy_from_logits",
    "check_kl_estimator",
    "closed_form_kl",
    "chosen_nll_loss",
    "gae",
    "gaussian_kl",
    "get_pair_loss",
    "get_policy_loss",
    "group_advantages",
    "kl_estimate",
    "kl_shaped_rewards",
    "local_normalizer",
    "orpo_odds_ratio_loss",
    "overlong_penalty",
    "register_pair_loss",
    "register_policy_loss",
    "rloo_advantages",
    "rollout_correction",
    "sequence_log_ratio",
    "simpo_loss",
    "whiten",
]
