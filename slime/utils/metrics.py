"""Rollout metrics under slime's names: pure functions on plain lists (no Ray, no HTTP, no torch).

`compute_eval_metrics` turns one eval set's rewards into `eval/<name>` (+ truncation, pass@k).
`rollout/zero_std/count` counts groups (by group index) whose raw rewards are all equal: such groups
carry no GRPO signal. `perf/rollout_tokens_per_sec` counts generated (response) tokens only.
"""

from __future__ import annotations

import math
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


def multi_turn_metrics(metadatas: list[dict | None]) -> dict[str, float]:
    """`rollout/multi_turn/turns_{mean,max}` and `rollout/multi_turn/tool_calls_{mean,max}` (--log-multi-turn)
    from the samples' metadata["turns"] / ["tool_calls"] (set by `multi_turn.tool_loop`, or by a custom
    generate function); empty when no sample has them."""
    out: dict[str, float] = {}
    for key in ("turns", "tool_calls"):
        values = [float(m[key]) for m in metadatas if m and isinstance(m.get(key), (int, float))]
        if values:
            out[f"rollout/multi_turn/{key}_mean"] = _mean(values)
            out[f"rollout/multi_turn/{key}_max"] = max(values)
    return out


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `num_correct` of `num_samples` correct: 1 - C(n-c, k) / C(n, k)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def compute_eval_metrics(
    name: str,
    rewards: list[float],
    truncated: list[bool],
    group_indices: list[int] | None = None,
    log_passrate: bool = False,
) -> dict[str, float]:
    """`eval/<name>` (mean reward), `eval/<name>-truncated_ratio` and, with `log_passrate`,
    `eval/<name>-pass@k` for k = 1, 2, 4, ... up to the smallest group (a sample counts as correct when
    its reward is > 0, which covers 0/1 and ±1 graders)."""
    n = len(rewards)
    metrics = {
        f"eval/{name}": _mean(rewards),
        f"eval/{name}-truncated_ratio": sum(map(bool, truncated)) / n if n else 0.0,
    }
    if log_passrate and n:
        groups: dict[int, list[float]] = defaultdict(list)
        for r, g in zip(rewards, group_indices if group_indices is not None else range(n)):
            groups[g].append(r)
        smallest = min(len(rs) for rs in groups.values())
        k = 1
        while k <= smallest:
            metrics[f"eval/{name}-pass@{k}"] = _mean(
                [pass_at_k(len(rs), sum(r > 0 for r in rs), k) for rs in groups.values()]
            )
            k *= 2
    return metrics


# --- weight-version staleness (train_async.py, fully async rollout) ----------------------------------------


def oldest_weight_version(weight_versions: list) -> int | None:
    """The oldest integer version stamped on a sample (one stamp per /generate call), None if it has none.
    The oldest counts because the sample's most off-policy tokens came from it. Non-integer stamps
    (an engine's "default" before the first push) are ignored."""
    versions = []
    for v in weight_versions or []:
        try:
            versions.append(int(v))
        except (TypeError, ValueError):
            continue
    return min(versions) if versions else None


def compute_weight_version_metrics(per_sample_versions: list[list]) -> dict[str, float]:
    """`rollout/weight_version/{min,mean,max}` over samples' oldest versions, and
    `rollout/mixed_version_samples`: samples whose response was generated by more than one version
    (a partial rollout continued after a weight push). Empty when no sample carries a version."""
    oldest = [v for v in (oldest_weight_version(vs) for vs in per_sample_versions) if v is not None]
    if not oldest:
        return {}
    mixed = sum(1 for vs in per_sample_versions if len({str(v) for v in vs or []}) > 1)
    return {
        "rollout/weight_version/min": float(min(oldest)),
        "rollout/weight_version/mean": _mean([float(v) for v in oldest]),
        "rollout/weight_version/max": float(max(oldest)),
        "rollout/mixed_version_samples": float(mixed),
    }


def compute_weight_version_lag(current_version: int, version_metrics: dict[str, float]) -> dict[str, float]:
    """`rollout/weight_version_lag/{mean,max}`: how many pushes the trainer's current version is ahead of
    the versions the samples were generated with (mean: of each sample's oldest version; max: of the
    oldest sample). Needs the metrics of `compute_weight_version_metrics`; empty without them."""
    if "rollout/weight_version/mean" not in version_metrics:
        return {}
    return {
        "rollout/weight_version_lag/mean": float(current_version) - version_metrics["rollout/weight_version/mean"],
        "rollout/weight_version_lag/max": float(current_version) - version_metrics["rollout/weight_version/min"],
    }


def wait_time_ratio(wait_s: float, total_s: float) -> float:
    """Fraction of `total_s` spent waiting, clamped to [0, 1] (0 for an empty interval)."""
    if total_s <= 0:
        return 0.0
    return min(1.0, max(0.0, wait_s / total_s))
