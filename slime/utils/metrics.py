"""Rollout metrics under slime's names: pure functions on plain lists (no Ray, no HTTP, no torch).

`rollout/zero_std/count` counts groups (by group index) whose raw rewards are all equal: such groups
carry no GRPO signal. `perf/rollout_tokens_per_sec` counts generated (response) tokens only.
"""

from __future__ import annotations

import statistics
from collections import defaultdict


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def zero_std_group_count(rewards: list[float], group_indices: list[int], tol: float = 1e-8) -> int:
    """Number of groups whose rewards are all equal (within `tol`)."""
    groups: dict[int, list[float]] = defaultdict(list)
    for r, g in zip(rewards, group_indices):
        groups[g].append(r)
    return sum(1 for rs in groups.values() if max(rs) - min(rs) <= tol)


def compute_rollout_metrics(
    raw_rewards: list[float],
    rewards: list[float],
    response_lengths: list[int],
    truncated: list[bool],
    group_indices: list[int],
    failed_count: int = 0,
    rollout_time: float | None = None,
) -> dict[str, float]:
    """The `rollout/*` and `perf/rollout_*` metrics of one rollout.

    `rewards` are the values training uses (group-normalised for GRPO-like estimators), `raw_rewards`
    the reward function's values. Empty input gives zeros rather than NaN so loggers never choke.
    """
    n = len(raw_rewards)
    metrics: dict[str, float] = {
        "rollout/raw_reward": _mean(raw_rewards),
        "rollout/rewards": _mean(rewards),
        "rollout/response_len/mean": _mean([float(x) for x in response_lengths]),
        "rollout/response_len/median": float(statistics.median(response_lengths)) if response_lengths else 0.0,
        "rollout/response_len/max": float(max(response_lengths, default=0)),
        "rollout/response_len/min": float(min(response_lengths, default=0)),
        "rollout/truncated_ratio": sum(map(bool, truncated)) / n if n else 0.0,
        "rollout/zero_std/count": float(zero_std_group_count(raw_rewards, group_indices)),
        "rollout/failed_count": float(failed_count),
    }
    if rollout_time is not None:
        metrics["perf/rollout_time"] = float(rollout_time)
        tokens = sum(response_lengths)
        metrics["perf/rollout_tokens_per_sec"] = tokens / rollout_time if rollout_time > 0 else 0.0
    return metrics
