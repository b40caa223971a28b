"""The zigzag layout of a packed row under context parallelism (slime/backends/megatron_utils/cp_layout.py) against
the per-sample zigzag chunks of slime's cp_utils (slime/observability/context_parallel.py), in closed form."""

from __future__ import annotations

import torch

from slime.backends.megatron_utils.cp_layout import pad_row, padded_boundaries, zigzag_layout
from slime.observability.context_parallel import _zigzag_chunks

CU = [0, 5, 6, 19, 27]  # four sequences of 5, 1, 13 and 8 tokens


def test_every_sequence_is_padded_to_a_multiple_of_twice_the_cp_size():
    assert padded_boundaries(CU, 2) == [0, 8, 12, 28, 36]
    assert padded_boundaries(CU, 3) == [0, 6, 12, 30, 42]
    assert padded_boundaries(CU, 1) == [0, 6, 8, 22, 30]


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence():
    for cp in (2, 3, 4):
        padded = padded_boundaries(CU, cp)
        held = []
        for rank in range(cp):
            layout = zigzag_layout(tuple(padded), cp, rank, "cpu")
            expected, positions = [], []
            for start, end in zip(padded[:-1], padded[1:]):
                _, chunks = _zigzag_chunks(end - start, cp, rank)  # slime's chunks of one sample
                for lo, hi in chunks:
                    expected += range(start + lo, start + hi)
                    positions += range(lo, hi)
            assert layout.local_index.tolist() == expected
            assert layout.local_positions.tolist() == positions
            assert list(layout.local_cu) == [p // cp for p in padded]
            held.append(layout.local_index)
        # gather_order reads the padded row back from the ranks' tokens, rank after rank
        everything = torch.cat(held)
        assert everything[layout.gather_order].tolist() == list(range(padded[-1]))


def test_pad_row_puts_each_sequence_at_its_padded_start():
    ids = torch.arange(100, 100 + CU[-1])
    padded = padded_boundaries(CU, 2)
    row, original = pad_row(ids, CU, padded, pad_value=-1)
    assert row.shape[0] == padded[-1] and torch.equal(row[original], ids)
    assert row[5:8].tolist() == [-1, -1, -1] and row[8].item() == 105  # sequence 0's padding, then sequence 1
    assert (row == -1).sum().item() == padded[-1] - CU[-1]
