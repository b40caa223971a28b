"""slime/backends/training/batching.py: token-budget micro-batches (--use-dynamic-batch-size), --balance-data
shares, and optimizer steps of rollouts split into several rows."""

from __future__ import annotations

import pytest

from slime.backends.training.batching import plan_micro_batches, split_by_tokens
from tests.args import make_args
from tests.forkserver import fork_context


def test_rows_grouped_under_the_padded_token_budget():
    # padded cost = rows × longest row: [5, 3] -> 2×5=10 <= 12; adding 7 -> 3×7=21 > 12
    assert split_by_tokens([0, 1, 2, 3, 4], [5, 3, 7, 2, 2], 12) == [[0, 1], [2], [3, 4]]


def test_a_row_longer_than_the_budget_goes_alone_and_order_is_kept():
    assert split_by_tokens([4, 9, 2], [3, 50, 3], 10) == [[4], [9], [2]]


@pytest.mark.parametrize("cp, packed, expected", [
    (1, True, [[0], [1], [2], [3]]),
    (2, True, [[0, 1, 2], [3]]),  # each CP rank runs half of a packed micro-batch's tokens
    (2, False, [[0], [1], [2], [3]]),  # padded rows are not split over CP ranks
])
def test_packed_budget_scales_with_context_parallelism(cp, packed, expected):
    args = make_args(validate=False, use_dynamic_batch_size=True, max_tokens_per_gpu=10,
                     log_probs_max_tokens_per_gpu=10, context_parallel_size=cp)
    tokens = [[1] * 6 for _ in range(4)]
    assert plan_micro_batches(args, tokens, range(4), packed=packed) == expected
    assert plan_micro_batches(args, tokens, range(4), packed=packed, log_probs=True) == expected


def test_every_row_is_used_once():
    rows, lengths = list(range(20)), [(7 * i) % 13 + 1 for i in range(20)]
    groups = split_by_tokens(rows, lengths, 16)
    assert [r for g in groups for r in g] == rows
    assert all(len(g) * max(lengths[r] for r in g) <= 16 or len(g) == 1 for g in groups)


@pytest.mark.parametrize("budget", [None, 0, -5])
def test_missing_budget_names_the_flag(budget):
    with pytest.raises(ValueError, match="--max-tokens-per-gpu"):
        split_by_tokens([0], [3], budget)


def test_split_into_halves_the_costliest_micro_batch_until_the_count():
    from slime.backends.training.batching import split_into

    rows, lengths = [0, 1, 2, 3, 4], [2, 2, 9, 9, 1]
    groups = split_by_tokens(rows, lengths, 100)  # one micro-batch of all five
    assert split_into(rows, lengths, groups, 3) == [[0, 1], [2], [3, 4]]
    with pytest.raises(ValueError, match="6 micro-batches of 5 rows"):
        split_into(rows, lengths, groups, 6)


def test_packed_budget_counts_each_rows_own_tokens():
    # packed cost = sum of lengths: 5 + 3 = 8 <= 12; + 7 = 15 > 12; 7 + 2 + 2 = 11 <= 12
    assert split_by_tokens([0, 1, 2, 3, 4], [5, 3, 7, 2, 2], 12, packed=True) == [[0, 1], [2, 3, 4]]


def test_packed_micro_batch_puts_sequences_back_to_back():
    from slime.backends.training.batching import make_packed_micro_batch

    mb = make_packed_micro_batch([[5, 6, 7], [8, 9], [1, 2, 3, 4]], [1, 1, 2])
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert mb.cu_seqlens == [0, 3, 5, 9]
    assert mb.response_starts == [2, 4, 7]  # positions in the packed row
    assert mb.row_of_sequence.tolist() == [0, 0, 0]
    assert mb.response_mask.tolist() == [[1.0, 0.0], [1.0, 0.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match="row 1: response_length=2 with 2 tokens"):
        make_packed_micro_batch([[1, 2, 3], [4, 5]], [1, 2])


def test_packed_row_padded_to_a_multiple_by_a_pad_sequence():
    from slime.backends.training.batching import make_packed_micro_batch

    mb = make_packed_micro_batch([[5, 6, 7], [8, 9]], [1, 1], pad_token_id=0, multiple=4)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert mb.cu_seqlens == [0, 3, 5, 8]  # the pad tokens form a sequence of their own
    assert mb.response_starts == [2, 4] and len(mb.row_of_sequence) == 2


# ---- --balance-data ----------------------------------------------------------------------------------------
def test_balanced_shares_equal_counts_and_close_token_sums():
    from slime.backends.training.batching import balanced_shares

    rows, lengths = list(range(8)), [10, 1, 1, 1, 10, 1, 1, 1]
    shares = balanced_shares(rows, lengths, 2)
    assert sorted(r for s in shares for r in s) == rows and [len(s) for s in shares] == [4, 4]
    assert [sum(lengths[r] for r in s) for s in shares] == [13, 13]
    skewed = [10, 10, 1, 1, 1, 1, 1, 1]  # contiguous halves: 22 vs 4 tokens
    assert sorted(sum(skewed[r] for r in s) for s in balanced_shares(rows, skewed, 2)) == [13, 13]
    assert all(s == sorted(s) for s in shares)  # each share keeps row order


def test_balance_data_keeps_rank_token_sums_close_on_long_tailed_lengths():
    """--balance-data on a long-tailed batch (each step's first group has four very long responses): the busiest
    rank holds at most the even share plus one row, where with contiguous shares it holds nearly all the tokens."""
    import random

    from slime.backends.training.batching import rows_per_step

    rng = random.Random(0)
    lengths = [rng.randint(1500, 2000) if i % 32 < 4 else rng.randint(20, 80) for i in range(64)]
    for ranks in (2, 4, 8):
        for step in range(2):
            rows = range(step * 32, step * 32 + 32)
            even, longest = sum(lengths[i] for i in rows) / ranks, max(lengths[i] for i in rows)
            loads = {}
            for balanced in (False, True):
                shares = [rows_per_step(64, 32, ranks, r, lengths if balanced else None)[step] for r in range(ranks)]
                assert sorted(i for share in shares for i in share) == list(rows)
                assert {len(share) for share in shares} == {32 // ranks}
                loads[balanced] = max(sum(lengths[i] for i in share) for share in shares)
            assert loads[True] <= even + longest and loads[True] < loads[False] / 1.7
            assert loads[False] > 0.75 * sum(lengths[i] for i in rows)  # contiguous: rank 0 has the long rows


def test_rows_per_step_balances_within_each_step_only():
    from slime.backends.training.batching import rows_per_step

    lengths = [9, 9, 1, 1, 5, 5, 5, 5]
    contiguous = [rows_per_step(8, 4, 2, r) for r in (0, 1)]
    assert contiguous == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    balanced = [rows_per_step(8, 4, 2, r, lengths) for r in (0, 1)]
    for step in range(2):  # the same rows in each optimizer step, equal counts, each rank one long and one short
        both = sorted(balanced[0][step] + balanced[1][step])
        assert both == list(range(step * 4, step * 4 + 4)) and len(balanced[0][step]) == len(balanced[1][step]) == 2
    assert [sum(lengths[r] for r in balanced[k][0]) for k in (0, 1)] == [10, 10]


# ---- rollouts split into several rows (a custom generate returning list[Sample]) ------------------------------
def test_a_step_is_global_batch_size_rollouts_with_their_rows_kept_together():
    from slime.backends.training.batching import step_rows

    # rollouts 7, 3, 9, 5 in order of appearance; 7 and 9 were split into 2 and 3 rows
    ids = [7, 7, 3, 9, 5, 9, 9]
    assert step_rows(7, 2, ids) == [[0, 1, 2], [3, 5, 6, 4]]
    assert step_rows(7, 4, ids) == [[0, 1, 2, 3, 5, 6, 4]]
    assert step_rows(4, 2) == [[0, 1], [2, 3]]  # one row per rollout: contiguous steps of gbs rows
    with pytest.raises(ValueError, match=r"4 rollouts \(in 7 samples\), which is not a multiple of "
                                         r"--global-batch-size 3"):
        step_rows(7, 3, ids)


def test_split_rollouts_shares_differ_by_at_most_one_row():
    from slime.backends.training.batching import balanced_shares, rows_per_step

    ids = [0, 0, 1, 2, 3]  # 4 rollouts in 5 rows, one step of gbs 4 over 2 ranks
    shares = [rows_per_step(5, 4, 2, r, rollout_ids=ids) for r in (0, 1)]
    assert shares == [[[0, 1, 2]], [[3, 4]]]
    lengths = [9, 9, 1, 1, 1]  # contiguous shares: 19 and 2 tokens
    balanced = [rows_per_step(5, 4, 2, r, lengths, ids)[0] for r in (0, 1)]
    assert sorted(balanced[0] + balanced[1]) == [0, 1, 2, 3, 4] and sorted(map(len, balanced)) == [2, 3]
    assert sorted(sum(lengths[r] for r in s) for s in balanced) == [10, 11]
    assert [len(s) for s in balanced_shares(list(range(7)), [1] * 7, 3)] == [3, 2, 2]


def test_rollout_mask_sums_are_per_rollout_token_counts():
    from slime.backends.training.batching import rollout_mask_sums

    masks = [[1, 1, 0], [1], [0, 0], [1, 1, 1, 1]]
    assert rollout_mask_sums(masks, [5, 5, 6, 7]) == [3.0, 3.0, 0.0, 4.0]
    assert rollout_mask_sums(masks, [0, 1, 2, 3]) == [2.0, 1.0, 0.0, 4.0]  # own rollouts: their own tokens


def _same_count_worker(rank: int, store_path: str, rows_of: list, micro_batch_sizes: list, results) -> None:
    import torch.distributed as dist

    from slime.backends.training.batching import same_count, split_micro_batches

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=len(rows_of))
    try:
        rows = rows_of[rank]
        # Each case is one all-reduce on every rank (same_count raises only after it), so the cases share a group.
        for case, micro_batch_size in enumerate(micro_batch_sizes):
            try:
                results[case, rank] = same_count(rows, [4] * len(rows), split_micro_batches(rows, micro_batch_size))
            except ValueError as e:
                results[case, rank] = str(e)
    finally:
        dist.destroy_process_group()


def _same_count(tmp_path, rows_of, micro_batch_sizes):
    """Each rank's result (its micro-batches, or its error) for each of `micro_batch_sizes`, over one gloo group
    (the ranks' processes start once for all the cases)."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        fork_context(__name__)  # tests/forkserver.py: the ranks fork from a server that imported torch once
        mp.start_processes(_same_count_worker, args=(str(tmp_path / "store"), rows_of, micro_batch_sizes, results),
                           nprocs=len(rows_of), start_method="forkserver")
        return [[results[case, r] for r in range(len(rows_of))] for case in range(len(micro_batch_sizes))]


def test_ranks_with_a_row_more_or_less_plan_as_many_micro_batches(tmp_path):
    """Over a real gloo group: 5 rows of a step over 2 ranks (3 + 2) with --micro-batch-size 2 would be 2 and 1
    micro-batches; FSDP forwards are collective, so the rank with fewer cuts one more. With 1 row per micro-batch
    it cannot: the error names the flags that fix it."""
    planned, errors = _same_count(tmp_path, [[0, 1, 2], [3, 4]], [2, 1])
    assert planned == [[[0, 1], [2]], [[3], [4]]]
    assert errors[0] == [[0], [1], [2]]
    assert "this rank has 2 rows of an optimizer step but another data-parallel rank runs 3 micro-batches" in errors[1]
    assert "--micro-batch-size 2 or more" in errors[1]


def test_sequences_and_slime_logits_of_padded_and_packed_micro_batches():
    import torch

    from slime.backends.training.batching import make_micro_batch, make_packed_micro_batch

    tokens, responses = [[5, 6, 7], [8, 9]], [1, 1]
    padded, packed = make_micro_batch(tokens, responses), make_packed_micro_batch(tokens, responses, multiple=4)
    for mb in (padded, packed):
        assert [t.tolist() for t in mb.sequences()] == tokens
    logits = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)  # [B, L, V] of the padded rows
    # slime's layout: row 0's 3 positions, then row 1's 2 (its pad position dropped)
    assert padded.slime_logits(logits).tolist() == [[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]]
    packed_logits = torch.zeros(1, 8, 2)
    assert packed.slime_logits(packed_logits) is packed_logits  # already back to back


def test_samples_carry_their_rollout_into_the_train_batch_and_its_steps():
    """A custom generate split rollouts 0 and 2 into two samples each (they share its rollout_id); the others
    have none and get the smallest ids no sample holds (slime's rule). 4 rollouts in 6 rows: one step of 4."""
    from slime.backends.training.batching import step_rows
    from slime.rollout.train_data import build_train_batch, rollout_count, train_batch_from_dict
    from slime.utils.types import Sample, TrainBatch
    from tests.args import make_args

    ids = [0, 0, None, 2, 2, None]
    samples = [Sample(group_index=i // 3, index=i, tokens=[5, 6, 7], response_length=1, reward=1.0, rollout_id=rid)
               for i, rid in enumerate(ids)]
    batch = build_train_batch(make_args(), samples)
    assert batch.rollout_ids == [0, 0, 1, 2, 2, 3] and rollout_count(samples) == 4
    assert batch.select([3, 0]).rollout_ids == [2, 0]
    assert step_rows(len(batch), 4, batch.rollout_ids) == [[0, 1, 2, 3, 4, 5]]
    data = {"tokens": [[1, 2]] * 6, "response_lengths": [1] * 6, "rewards": [0.0] * 6, "raw_reward": [0.0] * 6,
            "truncated": [0] * 6, "loss_masks": [[1]] * 6}
    assert train_batch_from_dict(data, samples, "convert", 2).rollout_ids == [0, 0, 1, 2, 2, 3]
    assert train_batch_from_dict({**data, "rollout_ids": [7] * 6}, samples, "convert", 2).rollout_ids == [7] * 6
    with pytest.raises(ValueError, match="TrainBatch.rollout_ids has 1 entries, tokens has 2"):
        TrainBatch(tokens=[[1, 2]] * 2, response_lengths=[1] * 2, loss_masks=[[1]] * 2, rewards=[0.0] * 2,
                   raw_rewards=[0.0] * 2, truncated=[False] * 2, group_indices=[0, 0], rollout_ids=[0])


# ---- per-row values to the device in one copy -------------------------------------------------------------
def test_predicting_positions_are_the_response_masks_ones_in_order():
    import torch

    from slime.backends.training.batching import make_micro_batch, make_packed_micro_batch

    tokens, responses = [[5, 6, 7, 1], [8, 9], [1, 2, 3, 4, 5]], [2, 0, 3]
    for mb in (make_micro_batch(tokens, responses), make_packed_micro_batch(tokens, responses, multiple=4)):
        t = torch.arange(mb.max_response_len).unsqueeze(0)
        valid = mb.response_mask.bool()
        want_pos = (torch.as_tensor(mb.response_starts).unsqueeze(1) - 1 + t)[valid]
        want_row = mb.row_of_sequence.unsqueeze(1).expand_as(valid)[valid]
        rows, positions = mb.predicting_positions()
        assert rows.tolist() == want_row.tolist() and positions.tolist() == want_pos.tolist()
        # each position predicts its response token
        assert mb.input_ids[rows, positions + 1].tolist() == [x for s, n in zip(tokens, responses) for x in s[len(s) - n:]]


def test_rows_on_device_is_one_storage_split_per_row():
    import torch

    from slime.backends.training.batching import rows_on_device

    rows = rows_on_device([[1, 0, 1], [], [0.5]], "cpu")
    assert [r.tolist() for r in rows] == [[1.0, 0.0, 1.0], [], [0.5]] and rows[0].dtype == torch.float32
    assert len({r.untyped_storage().data_ptr() for r in rows}) == 1  # one copy, not one per row
    grads = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([3.0], requires_grad=True)]
    sum(r.sum() * (i + 1) for i, r in enumerate(rows_on_device(grads, "cpu"))).backward()
    assert grads[0].grad.tolist() == [1.0, 1.0] and grads[1].grad.tolist() == [2.0]  # autograd follows the views
    assert rows_on_device([], "cpu") == []


def test_pad_per_token_pads_tensors_where_they_are_and_lists_alike():
    import torch

    from slime.backends.training.batching import pad_per_token

    want = [[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    values = [[1, 2], [4], []]
    assert pad_per_token(values, 3).tolist() == want
    assert pad_per_token([torch.tensor(v, dtype=torch.bfloat16) for v in values], 3).tolist() == want
    assert pad_per_token([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])], 2).tolist() == [[1, 2], [4, 0]]  # cut
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    pad_per_token([x], 3).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0]


def test_slot_positions_point_past_a_responses_end_at_zero():
    from slime.backends.training.batching import make_micro_batch

    mb = make_micro_batch([[5, 6, 7, 1], [8, 9, 4]], [2, 1])  # rows right-padded to 4; responses start at 2 and 2
    predicting, token = mb.slot_positions()
    assert predicting.tolist() == [[1, 2], [1, 0]] and token.tolist() == [[2, 3], [2, 0]]
    assert mb.slot_positions(logits_offset=1)[0].tolist() == [[0, 1], [0, 0]]
