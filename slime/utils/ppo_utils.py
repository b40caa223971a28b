"""slime's `slime.utils.ppo_utils`: the names plugins written for slime import from it, re-exported from where the
algorithm's math lives (slime/algorithm/): returns and advantages (`returns.py`), KL, losses, importance weights
and aggregation (`objectives.py`), and log-probs / entropy from vocab-parallel logits (`log_probs.py`).

A facade for plugins only: no module of `slime/` imports it (tests/unit/test_layers.py checks this).
"""

from __future__ import annotations

from slime.algorithm.log_probs import calculate_log_probs_and_entropy
from slime.algorithm.objectives import (
    KL_LOSS_TYPES,
    aggregate_loss,
    compute_approx_kl,
    compute_cispo_loss,
    compute_policy_loss,
    compute_value_loss,
    icepop_weights,
    opsm_mask,
    per_sample_masked_mean,
    sequence_ppo_kl,
    sum_of_sample_mean,
    tis_weights,
)
from slime.algorithm.returns import (
    chunked_discounted_returns,
    chunked_gae,
    get_advantages_and_returns_batch,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    group_normalize_rewards,
    kl_penalized_token_rewards,
    masked_moments,
    masked_whiten,
    vanilla_gae,
    whiten_with_moments,
)

__all__ = [
    "KL_LOSS_TYPES", "aggregate_loss", "calculate_log_probs_and_entropy", "chunked_discounted_returns", "chunked_gae",
    "compute_approx_kl", "compute_cispo_loss", "compute_policy_loss", "compute_value_loss",
    "get_advantages_and_returns_batch", "get_grpo_returns", "get_reinforce_plus_plus_baseline_advantages",
    "get_reinforce_plus_plus_returns", "group_normalize_rewards", "icepop_weights", "kl_penalized_token_rewards",
    "masked_moments", "masked_whiten", "opsm_mask", "per_sample_masked_mean", "sequence_ppo_kl",
    "sum_of_sample_mean", "tis_weights", "vanilla_gae", "whiten_with_moments",
]
