"""`slime.utils.metrics`: rollout metrics with closed-form expectations."""

import pytest

from slime.utils.metrics import compute_eval_metrics, compute_rollout_metrics, pass_at_k, zero_std_group_count


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


def test_pass_at_k_closed_form():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k


def test_eval_metrics_with_passrate():
    # two prompts x 4 samples: prompt 0 has 1 correct, prompt 1 has 4 correct (±1 grader counts > 0)
    rewards = [1, -1, -1, -1, 1, 1, 1, 1]
    m = compute_eval_metrics("toy", rewards, [False] * 7 + [True], [0] * 4 + [1] * 4, log_passrate=True)
    assert m["eval/toy"] == pytest.approx(2 / 8)
    assert m["eval/toy-truncated_ratio"] == pytest.approx(1 / 8)
    assert m["eval/toy-pass@1"] == pytest.approx((0.25 + 1) / 2)
    assert m["eval/toy-pass@2"] == pytest.approx((0.5 + 1) / 2)
    assert m["eval/toy-pass@4"] == pytest.approx(1.0)
    assert "eval/toy-pass@8" not in m
    assert set(compute_eval_metrics("x", [1.0], [False])) == {"eval/x", "eval/x-truncated_ratio"}


def test_engine_load_metrics():
    from slime.ray.rollout import engine_load_metrics

    m = engine_load_metrics([10, 4, 0], [16, 6, 4])
    assert m == {"rollout/engine_requests/0": 6.0, "rollout/engine_requests/1": 2.0,
                 "rollout/engine_requests/2": 4.0, "rollout/engine_load_imbalance": 1.5}
    assert engine_load_metrics(None, [1]) == {} and engine_load_metrics([1, 2], [1]) == {}
    assert engine_load_metrics([3], [3]) == {"rollout/engine_requests/0": 0.0}
