"""Pure helpers of the rollout side: samples -> TrainBatch, router flag forwarding, debug dumps."""

import math

import pytest

from slime.ray.rollout import router_args_from
from slime.rollout.router import router_cli_args
from slime.rollout.train_data import (
    build_train_batch,
    flatten_groups,
    load_debug_samples,
    replayed_samples,
    save_debug_samples,
    subsample_debug_samples,
    trim_to_whole_steps,
)
from slime.utils.types import Sample
from tests.args import make_args


def _args(**kw):
    """2 samples per prompt, GRPO unless `kw` says otherwise."""
    return make_args(**kw)


def _sample(group, index, reward, response_length=2, status=Sample.Status.COMPLETED, **kw):
    return Sample(
        group_index=group,
        index=index,
        tokens=[5, 6, 7] + [9] * response_length,
        response_length=response_length,
        reward=reward,
        status=status,
        rollout_log_probs=[-0.5] * response_length,
        **kw,
    )


def _groups():
    return [
        [_sample(0, 0, 1.0), _sample(0, 1, 0.0, status=Sample.Status.TRUNCATED)],
        [_sample(1, 2, 1.0), _sample(1, 3, 1.0)],
    ]


def test_grpo_batch_is_group_normalised():
    pytest.importorskip("slime.utils.ppo_utils")
    batch = build_train_batch(_args(), flatten_groups(_groups(), "test"))
    assert len(batch) == 4
    assert batch.raw_rewards == [1.0, 0.0, 1.0, 1.0]
    # group 0: mean 0.5, unbiased std sqrt(0.5); group 1: zero std -> 0
    s = math.sqrt(0.5)
    assert batch.rewards == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.0, 0.0], abs=1e-6)
    assert batch.truncated == [False, True, False, False]
    assert batch.group_indices == [0, 0, 1, 1]
    assert batch.loss_masks == [[1, 1]] * 4
    assert batch.rollout_log_probs == [[-0.5, -0.5]] * 4
    assert batch.tokens[0] == [5, 6, 7, 9, 9]


def test_dr_grpo_only_subtracts_the_mean():
    pytest.importorskip("slime.utils.ppo_utils")
    batch = build_train_batch(_args(disable_grpo_std_normalization=True), flatten_groups(_groups(), "test"))
    assert batch.rewards == pytest.approx([0.5, -0.5, 0.0, 0.0], abs=1e-6)


def test_ppo_keeps_raw_rewards_and_dict_rewards_use_reward_key():
    groups = [[_sample(0, 0, {"score": 2.0, "acc": 1}), _sample(0, 1, {"score": -1.0, "acc": 0})]]
    batch = build_train_batch(_args(advantage_estimator="ppo", reward_key="score"), flatten_groups(groups, "t"))
    assert batch.rewards == batch.raw_rewards == [2.0, -1.0]
    with pytest.raises(ValueError, match="--reward-key"):
        build_train_batch(_args(advantage_estimator="ppo"), flatten_groups(groups, "t"))


def test_loss_mask_kept_failed_sample_masked_and_mismatch_named():
    s0 = _sample(0, 0, 1.0, response_length=3, loss_mask=[1, 0, 1])
    s1 = _sample(0, 1, None, response_length=3, status=Sample.Status.FAILED)
    batch = build_train_batch(_args(advantage_estimator="ppo"), [s0, s1])
    assert batch.loss_masks == [[1, 0, 1], [0, 0, 0]]
    assert batch.raw_rewards == [1.0, 0.0]
    bad = _sample(0, 0, 1.0, response_length=3, loss_mask=[1, 1])
    with pytest.raises(ValueError, match="loss_mask has 2 entries but response_length=3"):
        build_train_batch(_args(advantage_estimator="ppo"), [bad])


def test_missing_log_probs_give_none():
    s = _sample(0, 0, 1.0)
    s.rollout_log_probs = None
    batch = build_train_batch(_args(advantage_estimator="ppo"), [s, _sample(0, 1, 0.0)])
    assert batch.rollout_log_probs is None


def test_flatten_rejects_non_samples():
    assert len(flatten_groups([_sample(0, 0, 1.0), [_sample(1, 1, 0.0)]], "t")) == 2
    with pytest.raises(TypeError, match="--rollout-function-path=my.fn"):
        flatten_groups([[{"not": "a sample"}]], "my.fn")
    with pytest.raises(TypeError, match="expected list"):
        flatten_groups(None, "my.fn")


def test_router_flags():
    assert router_cli_args({"request_timeout_secs": 30, "disable_retries": True, "dp_aware": False, "x": None}) == [
        "--request-timeout-secs",
        "30",
        "--disable-retries",
    ]
    assert router_cli_args({"worker_urls": ["a", "b"]}) == ["--worker-urls", "a", "b"]
    args = make_args("--router-balance-abs-threshold", "4", "--router-disable-retries", "--router-policy",
                     "cache_aware", "--sglang-router-request-timeout-secs", "99")
    assert router_args_from(args) == {
        "balance_abs_threshold": "4",
        "disable_retries": True,
        "policy": "cache_aware",
        "request_timeout_secs": 99,
        "disable_circuit_breaker": True,  # as slime: engine health is judged by slime, not by the router
        "disable_health_check": True,
    }


def test_debug_dump_round_trip(tmp_path):
    samples = flatten_groups(_groups(), "t")
    path = save_debug_samples(str(tmp_path / "dump" / "rollout_{rollout_id}.pt"), 3, samples)
    assert path.endswith("rollout_3.pt")
    back = load_debug_samples(str(tmp_path / "dump" / "rollout_{rollout_id}.pt"), 3)
    assert [s.to_dict() for s in back] == [s.to_dict() for s in samples]
    with pytest.raises(FileNotFoundError, match="--load-debug-rollout-data"):
        load_debug_samples(str(tmp_path / "dump" / "rollout_{rollout_id}.pt"), 4)


def test_debug_subsample_keeps_the_head_and_the_tail():
    samples = [_sample(i // 2, i, float(i)) for i in range(10)]
    picked = lambda ratio: [s.index for s in subsample_debug_samples(samples, ratio)]  # noqa: E731
    assert picked(1.0) == list(range(10))
    assert picked(0.5) == [0, 1, 7, 8, 9]  # int(10 x 0.5) = 5 rows: 5 // 2 from the start, the other 3 from the end
    assert picked(0.4) == [0, 1, 8, 9]
    assert picked(0.1) == [9]
    with pytest.raises(ValueError, match=r"keeps int\(10 x 0.05\) = 0 of the 10 saved samples"):
        subsample_debug_samples(samples, 0.05)


def test_trim_to_whole_steps_drops_the_trailing_rollouts():
    samples = [_sample(i // 2, i, 0.0) for i in range(7)]
    assert [s.index for s in trim_to_whole_steps(samples, 2)] == [0, 1, 2, 3, 4, 5]
    assert [s.index for s in trim_to_whole_steps(samples, 7)] == list(range(7))
    # rows split from one rollout (a shared rollout_id) count once and stay together
    split = [_sample(0, i, 0.0, rollout_id=rid) for i, rid in enumerate([4, 4, 9, 1, 1, 1])]
    assert [s.index for s in trim_to_whole_steps(split, 2)] == [0, 1, 2]
    with pytest.raises(ValueError, match="3 rollouts are fewer than --global-batch-size 4"):
        trim_to_whole_steps(split, 4)


def test_replayed_samples_from_a_saved_dump(tmp_path):
    """A dump written by save_debug_samples, read back through the flags as the rollout manager reads it."""
    template = str(tmp_path / "rollout_{rollout_id}.pt")
    samples = [_sample(i // 2, i, float(i % 2)) for i in range(8)]
    save_debug_samples(template, 2, samples)
    args = make_args("--load-debug-rollout-data", template, "--global-batch-size", "2")
    assert [s.to_dict() for s in replayed_samples(args, 2)] == [s.to_dict() for s in samples]
    args = make_args("--load-debug-rollout-data", template, "--load-debug-rollout-data-subsample", "0.75",
                     "--global-batch-size", "2")
    # int(8 x 0.75) = 6 rows: 0, 1, 2 and 5, 6, 7; whole steps of 2 rollouts: 6 rows
    assert [s.index for s in replayed_samples(args, 2)] == [0, 1, 2, 5, 6, 7]
    args = make_args("--load-debug-rollout-data", template, "--load-debug-rollout-data-subsample", "0.375",
                     "--global-batch-size", "2")
    assert [s.index for s in replayed_samples(args, 2)] == [0, 6]  # 3 rows, 0 and 6, 7: one whole step of 2
    args = make_args("--load-debug-rollout-data", template, "--load-debug-rollout-data-subsample", "0.125",
                     "--global-batch-size", "2")
    with pytest.raises(ValueError, match=r"rollout 2 \(.*rollout_2.pt\): 1 rollouts are fewer than "
                                         r"--global-batch-size 2.*subsample 0.125 of 8 samples"):
        replayed_samples(args, 2)
