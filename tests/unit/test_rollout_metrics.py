"""`slime.utils.metrics`: rollout metrics with closed-form expectations."""

import pytest

from slime.utils.metrics import compute_rollout_metrics, zero_std_group_count


def test_rollout_metrics_closed_form():
    # Two groups of three: group 0 has rewards 1, 0, 1; group 1 is all zeros (no GRPO signal).
    m = compute_rollout_metrics(
        raw_rewards=[1.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        rewards=[0.5, -1.0, 0.5, 0.0, 0.0, 0.0],
        response_lengths=[4, 2, 10, 6, 8, 6],
        truncated=[False, False, True, False, True, False],
        group_indices=[0, 0, 0, 1, 1, 1],
        failed_count=1,
        rollout_time=2.0,
    )
    assert m["rollout/raw_reward"] == pytest.approx(2 / 6)
    assert m["rollout/rewards"] == pytest.approx(0.0)
    assert m["rollout/response_len/mean"] == pytest.approx(6.0)
    assert m["rollout/response_len/median"] == pytest.approx(6.0)
    assert m["rollout/response_len/max"] == 10.0
    assert m["rollout/response_len/min"] == 2.0
    assert m["rollout/truncated_ratio"] == pytest.approx(2 / 6)
    assert m["rollout/zero_std/count"] == 1.0
    assert m["rollout/failed_count"] == 1.0
    assert m["perf/rollout_time"] == 2.0
    assert m["perf/rollout_tokens_per_sec"] == pytest.approx(36 / 2.0)


def test_median_of_even_count_and_no_timing():
    m = compute_rollout_metrics([0.0] * 4, [0.0] * 4, [1, 2, 3, 10], [False] * 4, [0, 0, 1, 1])
    assert m["rollout/response_len/median"] == 2.5
    assert m["rollout/zero_std/count"] == 2.0
    assert "perf/rollout_time" not in m and "perf/rollout_tokens_per_sec" not in m


def test_zero_std_groups_by_group_index_not_position():
    # Interleaved group indices: group 7 = {1, 1}, group 3 = {0, 1}.
    assert zero_std_group_count([1.0, 0.0, 1.0, 1.0], [7, 3, 7, 3]) == 1
    assert zero_std_group_count([0.5, 0.5 + 1e-12], [0, 0]) == 1
    assert zero_std_group_count([], []) == 0


def test_empty_rollout_gives_zeros_not_nan():
    m = compute_rollout_metrics([], [], [], [], [], rollout_time=0.0)
    assert all(v == 0.0 for v in m.values()), m
