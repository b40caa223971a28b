"""`slime.utils.dp_schedule.build_dp_schedule`: slime's call, answered with the trainers' batching
(slime/backends/training/batching.py), in closed form."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime.backends.training.batching import rows_per_step
from slime.utils.dp_schedule import build_dp_schedule


def _args(**kw):
    base = {"micro_batch_size": 1, "use_dynamic_batch_size": False, "max_tokens_per_gpu": None, "balance_data": False}
    return SimpleNamespace(**{**base, **kw})


def _parallel(dp_size=1, cp_size=1, vpp_size=1, group=1):
    return {"dp_size": dp_size, "cp_size": cp_size, "vpp_size": vpp_size, "microbatch_group_size_per_vp_stage": group}


def test_static_micro_batches_of_each_ranks_contiguous_share():
    partitions, micro_batches, counts, gbs = build_dp_schedule(
        _args(micro_batch_size=2), _parallel(dp_size=2), [5] * 8, global_batch_size=4, rollout_indices=list(range(8)))
    # two steps of 4 rollouts; rank 0 takes the first two rows of each step, rank 1 the last two
    assert partitions == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert micro_batches == [[[0, 1], [2, 3]], [[0, 1], [2, 3]]]
    assert (counts, gbs) == ([1, 1], [4, 4])
    assert [partitions[r][:2] for r in (0, 1)] == [rows_per_step(8, 4, 2, r)[0] for r in (0, 1)]


def test_balance_data_gives_the_trainers_token_balanced_shares():
    lengths = [9, 9, 1, 1]
    partitions, _, _, _ = build_dp_schedule(_args(balance_data=True), _parallel(dp_size=2), lengths,
                                            global_batch_size=4, rollout_indices=[0, 1, 2, 3])
    assert partitions == [[0, 2], [1, 3]]  # not [[0, 1], [2, 3]] (18 vs 2 tokens)
    assert partitions == [rows_per_step(4, 4, 2, r, lengths)[0] for r in (0, 1)]


def test_token_budget_micro_batches_are_cut_to_the_same_count_on_every_rank():
    # --max-tokens-per-gpu 10 × CP 1: rank 0's rows [8, 1, 1] pack as [8, 1, 1] (10 tokens); rank 1's [6, 6, 6]
    # need three micro-batches, so rank 0's is halved until it has three too
    lengths = [8, 1, 1, 6, 6, 6]
    partitions, micro_batches, counts, _ = build_dp_schedule(
        _args(use_dynamic_batch_size=True, max_tokens_per_gpu=10), _parallel(dp_size=2), lengths,
        global_batch_size=2, rollout_indices=[0, 0, 0, 1, 1, 1])
    assert partitions == [[0, 1, 2], [3, 4, 5]]
    assert micro_batches == [[[0], [1], [2]], [[0], [1], [2]]]
    assert counts == [3]
    # with CP 2 a micro-batch holds 20 tokens (each CP rank a half): each rank's rows fit in one
    _, micro_batches, counts, _ = build_dp_schedule(
        _args(use_dynamic_batch_size=True, max_tokens_per_gpu=10), _parallel(dp_size=2, cp_size=2), lengths,
        global_batch_size=2, rollout_indices=[0, 0, 0, 1, 1, 1])
    assert micro_batches == [[[0, 1, 2]], [[0, 1, 2]]] and counts == [1]


def test_virtual_pipeline_stages_round_the_count_up_to_a_group_multiple():
    _, micro_batches, counts, _ = build_dp_schedule(
        _args(micro_batch_size=2), _parallel(dp_size=1, vpp_size=2, group=4), [3] * 6, global_batch_size=6,
        rollout_indices=list(range(6)))
    assert counts == [4]  # three micro-batches of two rows, one of them halved
    assert [i for mb in micro_batches[0] for i in mb] == list(range(6)) and len(micro_batches[0]) == 4


def test_a_rollout_count_not_filling_the_steps_is_an_error_naming_the_flags():
    with pytest.raises(ValueError, match="3 rollouts, which is not a multiple of --global-batch-size 2"):
        build_dp_schedule(_args(), _parallel(), [3] * 3, global_batch_size=2, rollout_indices=[0, 1, 2])
