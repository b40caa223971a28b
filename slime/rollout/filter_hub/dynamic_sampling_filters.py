"""Ready-made `--dynamic-sampling-filter-path` functions (DAPO-style dynamic sampling).

- `check_reward_nonzero_std`: keep a group only when its rewards differ (std > 1e-6); a group where every
  response scored the same gives GRPO no signal. Dropped as `zero_std_<the reward, 1 decimal>`.
- `check_reward_nonzero_std_with_fallback`: the same, but a rejected group is kept when the rollout would
  otherwise run short of groups (`keep_when_insufficient`), instead of over-sampling again.
"""

from __future__ import annotations

import statistics
from typing import Any

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]

MIN_STD = 1e-6


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    rewards = [s.scalar_reward(args.reward_key) for s in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > MIN_STD
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output
