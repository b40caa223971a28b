"""slime/backends/training/batching.py: token-budget micro-batches (--use-dynamic-batch-size)."""

from __future__ import annotations

import pytest

from slime.backends.training.batching import split_by_tokens


def test_rows_grouped_under_the_padded_token_budget():
    # padded cost = rows × longest row: [5, 3] -> 2×5=10 <= 12; adding 7 -> 3×7=21 > 12
    assert split_by_tokens([0, 1, 2, 3, 4], [5, 3, 7, 2, 2], 12) == [[0, 1], [2], [3, 4]]


def test_a_row_longer_than_the_budget_goes_alone_and_order_is_kept():
    assert split_by_tokens([4, 9, 2], [3, 50, 3], 10) == [[4], [9], [2]]


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
