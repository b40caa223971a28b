"""slime/backends/megatron_utils/packed_rope.py: one-call rotary embedding of packed sequences equals
megatron-core's per-sequence one."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


def test_token_positions_restart_at_every_sequence():
    from slime.backends.megatron_utils.packed_rope import token_positions

    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    assert token_positions(cu, 9).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


@pytest.mark.parametrize("whole_pack", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_patched_thd_rotary_equals_megatron_cores(whole_pack, interleaved):
    from megatron.core.models.common.embeddings import rope_utils

    from slime.backends.megatron_utils import packed_rope

    original = rope_utils._apply_rotary_pos_emb_thd

    class OneRank:  # the context-parallel group of a single rank
        def size(self):
            return 1

        def rank(self):
            return 0

    torch.manual_seed(0)
    lengths = [7, 1, 12, 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total, dim = sum(lengths), 16
    t = torch.randn(total, 3, dim, dtype=torch.float64)
    positions = total if whole_pack else max(lengths)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
    freqs = (torch.cat([angles, angles], -1) if not interleaved else angles.repeat_interleave(2, -1))[:, None, None]
    expected = original(t, cu, freqs, interleaved, False, 1.0, OneRank())
    try:
        assert packed_rope.install()
        assert packed_rope.install()  # idempotent
        ours = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, interleaved, False, 1.0, OneRank())
    finally:
        rope_utils._apply_rotary_pos_emb_thd = original
    assert torch.equal(ours, expected)
