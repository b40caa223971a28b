"""Bounded staleness (--max-policy-version-lag): per-token policy versions on Sample, the lag filter and its
metrics (closed form), the collection bound of the fully async rollout, train_async's refusal of a bound that
drops everything, the rollout-module weight-update hooks, and off-policy correction over resumed segments."""

from __future__ import annotations

import pickle
import sys
import types

import pytest
import torch

from slime.config.arguments import SlimeArgumentError
from slime.rollout.base_types import lifecycle_of, rollout_lifecycle
from slime.rollout.sglang_rollout import append_model_tokens
from slime.rollout.staleness import (
    apply_policy_version_lag,
    collection_lag_bound,
    offpolicy_token_share,
    pushes_before_training,
    stale_groups,
)
from slime.rollout.train_data import build_train_batch
from slime.utils import ppo_utils
from slime.utils.types import Sample, TrainBatch
from tests.args import make_args

# --- versions on Sample -----------------------------------------------------------------------------------


def _resumed_sample() -> Sample:
    """A partial rollout: 2 tokens by version 3, cut by a push, then 3 more by version 4."""
    s = Sample(tokens=[5, 6])
    append_model_tokens(s, [7, 8], [-0.1, -0.2], "ab", weight_version="3")
    append_model_tokens(s, [9, 10, 11], [-1.0, -2.0, -3.0], "cde", weight_version="4")
    return s


def test_each_segment_of_a_resumed_sample_keeps_its_version():
    s = _resumed_sample()
    assert s.weight_versions == ["3", "4"]
    assert s.token_policy_versions == [3, 3, 4, 4, 4]
    assert s.rollout_log_probs == [-0.1, -0.2, -1.0, -2.0, -3.0]
    assert s.policy_version == 3  # the oldest segment decides the staleness


def test_tool_tokens_and_unversioned_engines_get_minus_one():
    s = Sample(tokens=[1])
    s.append_response_tokens(tokens=[2, 3], log_probs=[-0.5, -0.5], meta_info={"weight_version": "default"})
    s.append_response_tokens(tokens=[4], trainable=False)
    s.append_response_tokens(tokens=[5], log_probs=[-0.1], meta_info={"weight_version": 6})
    assert s.token_policy_versions == [-1, -1, -1, 6]
    assert s.policy_version == 6  # "default" (before any push) is not a version
    assert Sample().policy_version is None


def test_a_plugin_that_extended_the_response_itself_is_padded():
    s = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0])
    s.append_response_tokens(tokens=[4], log_probs=[-0.2], meta_info={"weight_version": "2"})
    assert s.token_policy_versions == [-1, -1, 2]


def test_policy_version_round_trips_through_dict():
    s = _resumed_sample()
    d = s.to_dict()
    assert d["policy_version"] == 3 and d["token_policy_versions"] == [3, 3, 4, 4, 4]
    back = Sample.from_dict(pickle.loads(pickle.dumps(d)))
    assert back == s and back.policy_version == 3
    # a producer's stale policy_version is not trusted: the versions decide
    assert Sample.from_dict({**d, "policy_version": 99}).policy_version == 3
    # an older dump (no per-token versions) still has a version from weight_versions
    assert Sample.from_dict({"weight_versions": ["5", "2"]}).policy_version == 2


def test_train_batch_carries_row_and_token_versions():
    args = make_args(n_samples_per_prompt=2, rm_type="toy")
    fresh = Sample(group_index=0, index=1, tokens=[5, 6], reward=1.0)
    append_model_tokens(fresh, [7, 8, 9, 10, 11], [-0.5] * 5, "x", weight_version="4")
    resumed = _resumed_sample()
    resumed.group_index, resumed.index, resumed.reward = 0, 0, 0.0
    batch = build_train_batch(args, [resumed, fresh])
    assert batch.policy_versions == [3, 4]
    assert batch.token_policy_versions == [[3, 3, 4, 4, 4], [4] * 5]
    with pytest.raises(ValueError, match="token_policy_versions has 2 entries, response_length=5"):
        TrainBatch(**{**batch.__dict__, "token_policy_versions": [[1, 1], [4] * 5]})


# --- the lag filter and its metrics -----------------------------------------------------------------------


def _batch(versions: list[int | None], groups: list[int], token_versions=None, masks=None) -> TrainBatch:
    n = len(versions)
    masks = masks or [[1, 1] for _ in range(n)]
    return TrainBatch(tokens=[[0, 1, 2]] * n, response_lengths=[len(m) for m in masks], loss_masks=masks,
                      rewards=[0.0] * n, raw_rewards=[0.0] * n, truncated=[False] * n, group_indices=groups,
                      policy_versions=versions, token_policy_versions=token_versions)


def test_stale_groups_are_whole_groups():
    # group 0: lags 0 and 2; group 1: lags 1 and 1; group 2: no version
    versions, groups = [5, 3, 4, 4, None, None], [0, 0, 1, 1, 2, 2]
    assert stale_groups(groups, versions, 5, 1) == {0}
    assert stale_groups(groups, versions, 5, 0) == {0, 1}
    assert stale_groups(groups, versions, 5, None) == set()
    assert stale_groups(groups, versions, None, 0) == set()


def test_apply_policy_version_lag_drops_whole_groups_and_measures():
    batch = _batch([5, 3, 4, 4, None, None], [0, 0, 1, 1, 2, 2])
    m = apply_policy_version_lag(batch, 5, 1)
    assert batch.loss_masks == [[0, 0], [0, 0], [1, 1], [1, 1], [1, 1], [1, 1]]
    assert m["rollout/policy_version"] == 5.0
    assert (m["rollout/policy_version_lag_min"], m["rollout/policy_version_lag_max"]) == (0.0, 2.0)
    assert m["rollout/policy_version_lag_mean"] == pytest.approx((0 + 2 + 1 + 1) / 4)
    assert m["rollout/stale_samples_dropped"] == 2.0 and m["rollout/stale_groups_dropped"] == 1.0
    assert m["rollout/unversioned_samples"] == 2.0
    # trained tokens with a version: rows 2 and 3 (both version 4 < 5): all off-policy
    assert m["rollout/offpolicy_token_share"] == 1.0


def test_no_bound_drops_nothing_but_still_measures():
    batch = _batch([5, 3], [0, 0])
    m = apply_policy_version_lag(batch, 5, None)
    assert batch.loss_masks == [[1, 1], [1, 1]]
    assert m["rollout/stale_samples_dropped"] == 0.0 and m["rollout/policy_version_lag_max"] == 2.0
    assert m["rollout/offpolicy_token_share"] == 0.5


def test_offpolicy_share_counts_segments_and_skips_masked_and_unknown_tokens():
    # row 0: a resumed sample [3, 3, 4, 4] with its first token masked; row 1: a tool token (-1) and version 4
    batch = _batch([3, 4], [0, 0], token_versions=[[3, 3, 4, 4], [-1, 4, 4, 4]],
                   masks=[[0, 1, 1, 1], [0, 1, 1, 1]])
    assert offpolicy_token_share(batch, 4) == pytest.approx(1 / 6)
    assert offpolicy_token_share(batch, 5) == 1.0
    assert offpolicy_token_share(_batch([None], [0]), 4) is None


def test_collection_bound_leaves_room_for_the_pushes_before_training():
    assert pushes_before_training(1, 1) == 1  # one step off: one push between collection and training
    assert pushes_before_training(2, 1) == 2
    assert pushes_before_training(1, 2) == 1 and pushes_before_training(3, 2) == 2
    assert collection_lag_bound(2, 1) == 1
    assert collection_lag_bound(1, 2) == 0  # never negative: that would regenerate forever
    assert collection_lag_bound(None, 1) is None


def test_the_fully_async_worker_collects_within_the_bound_minus_the_pushes_ahead():
    from slime.rollout.fully_async_rollout import AsyncRolloutWorker

    class NoSource:
        def get_samples(self, n):
            return []

    def worker(**kw):
        return AsyncRolloutWorker(make_args(rollout_max_response_len=4, **kw), NoSource(), 1)

    assert worker(max_policy_version_lag=2).max_staleness == 1
    assert worker(max_policy_version_lag=2, async_buffer_size=2).max_staleness == 0
    assert worker().max_staleness is None


def test_flag_and_its_former_name_and_validation():
    assert make_args("--max-policy-version-lag", "2").max_policy_version_lag == 2
    assert make_args("--max-weight-staleness", "3").max_policy_version_lag == 3
    assert make_args().max_policy_version_lag is None
    with pytest.raises(SlimeArgumentError, match="--max-policy-version-lag -1: must be >= 0"):
        make_args("--max-policy-version-lag", "-1")


def test_train_async_refuses_a_bound_that_drops_every_rollout():
    import train_async

    with pytest.raises(SlimeArgumentError, match="--max-policy-version-lag 0: .*at least 1 version"):
        train_async.check_async_args(make_args(max_policy_version_lag=0))
    with pytest.raises(SlimeArgumentError, match="--max-policy-version-lag 1: .*at least 2 version.*lag 2 or more"):
        train_async.check_async_args(make_args(max_policy_version_lag=1, async_buffer_size=2))
    # pushes every other step: some rollouts are generated after the latest push (lag 0)
    train_async.check_async_args(make_args(max_policy_version_lag=0, update_weights_interval=2))
    train_async.check_async_args(make_args(max_policy_version_lag=1, async_buffer_size=3, update_weights_interval=2))
    train_async.check_async_args(make_args(max_policy_version_lag=1))
    train_async.check_async_args(make_args())


# --- weight-update hooks: the decorator and slime's module functions are one mechanism --------------------


def _module_with_hooks(name: str, calls: list) -> types.ModuleType:
    module = types.ModuleType(name)

    def before_weight_update(args):
        calls.append(("before", args))

    def after_weight_update(args, weight_version):
        calls.append(("after", args, weight_version))

    def rollout(args, rollout_id, data_source, evaluation=False):
        return []

    for fn in (before_weight_update, after_weight_update, rollout):
        fn.__module__ = name
        setattr(module, fn.__name__, fn)
    return module


def test_module_level_hooks_are_found(monkeypatch):
    calls: list = []
    module = _module_with_hooks("staleness_test_rollout_mod", calls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    lifecycle = lifecycle_of(module.rollout)
    lifecycle.before_weight_update("a")
    lifecycle.after_weight_update("a", 7)
    assert calls == [("before", "a"), ("after", "a", 7)] and lifecycle.shutdown is None

    def plain(args, rollout_id, data_source, evaluation=False):
        return []

    empty = lifecycle_of(plain)  # this test module defines no hooks
    assert (empty.before_weight_update, empty.after_weight_update, empty.shutdown) == (None, None, None)


def test_decorator_wins_over_module_functions(monkeypatch):
    calls: list = []
    module = _module_with_hooks("staleness_test_rollout_mod2", calls)
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def mine(args):
        calls.append(("mine", args))

    decorated = rollout_lifecycle(before_weight_update=mine)(module.rollout)
    lifecycle_of(decorated).before_weight_update("b")
    assert calls == [("mine", "b")] and lifecycle_of(decorated).after_weight_update is None


def test_fully_async_module_functions_are_its_declared_hooks():
    from slime.rollout import fully_async_rollout as fa

    lifecycle = lifecycle_of(fa.generate_rollout_fully_async)
    assert lifecycle.before_weight_update is fa.before_weight_update
    assert lifecycle.after_weight_update is fa.after_weight_update


# --- off-policy correction over resumed segments ----------------------------------------------------------


def test_tis_weighs_each_segment_by_its_own_behaviour_log_probs():
    """AReaL's decoupled objective: the proximal policy is the recomputed old log-probs, the behaviour policy the
    engine's log-probs of each token as generated. A resumed sample's segments came from different versions, and
    each token's importance weight must use its own segment's log-prob."""
    args = make_args(n_samples_per_prompt=2, rm_type="toy")
    s = _resumed_sample()
    s.group_index, s.index, s.reward = 0, 0, 1.0
    batch = build_train_batch(args, [s])
    behaviour = torch.tensor(batch.rollout_log_probs[0])
    proximal = torch.tensor([-0.3, -0.3, -1.5, -1.5, -1.5])
    weights, _ = ppo_utils.tis_weights(proximal, behaviour, tis_clip=100.0)
    expected = torch.exp(proximal - torch.tensor([-0.1, -0.2, -1.0, -2.0, -3.0]))
    assert torch.allclose(weights, expected)
    # the version-4 segment's tokens are weighted by version 4's log-probs, not version 3's
    assert batch.token_policy_versions[0][2:] == [4, 4, 4]
    assert weights[2:].tolist() == pytest.approx(torch.exp(torch.tensor([-0.5, 0.5, 1.5])).tolist())
