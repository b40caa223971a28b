"""slime's `slime.backends.megatron_utils.cp_utils`: the context-parallel helpers plugins written for slime call,
re-exported from slime/observability/context_parallel.py (their implementation and documentation).

A facade for plugins only: no module of `slime/` imports it (tests/unit/test_layers.py checks this).
The name is an alias of the home module (`sys.modules`), so what a plugin or a test sets on it is what the code
reads.
"""

from __future__ import annotations

import sys

from slime.observability import context_parallel

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

sys.modules[__name__] = context_parallel
