"""slime's `slime.backends.megatron_utils.cp_utils`: the context-parallel helpers plugins written for slime call,
re-exported from slime/observability/context_parallel.py (their implementation and documentation).

A facade for plugins only: no module of `slime/` imports it (tests/unit/test_layers.py checks this).
"""

from __future__ import annotations

from slime.observability.context_parallel import (
    all_gather_with_cp,
    cp_size_and_rank,
    get_logits_and_tokens_offset_with_cp,
    get_sum_of_sample_mean,
    parallel_state,
    slice_log_prob_with_cp,
    slice_with_cp,
)

__all__ = ["all_gather_with_cp", "cp_size_and_rank", "get_logits_and_tokens_offset_with_cp", "get_sum_of_sample_mean",
           "parallel_state", "slice_log_prob_with_cp", "slice_with_cp"]
