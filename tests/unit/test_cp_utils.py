"""`slime.backends.megatron_utils.cp_utils`: without megatron-core's parallel groups there is no context
parallelism; over a real gloo group with megatron-core's CP = 2, the zigzag layout in closed form, slice and
gather as inverses, the reducer's CP shares adding up, and the `--save-debug-train-data` file holding whole
values."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from slime.backends.megatron_utils import cp_utils
from tests.forkserver import fork_context


def test_without_megatron_parallel_groups_everything_is_the_identity_or_a_per_sample_sum():
    assert cp_utils.cp_size_and_rank() == (1, 0)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert cp_utils.all_gather_with_cp(values, 9, 5) is values
    assert cp_utils.slice_log_prob_with_cp([0.1, 0.2], 4, 2) == [0.1, 0.2]
    assert cp_utils.slice_with_cp(values, 0) is values
    # one chunk pair covering the whole sequence: [0, 5) and [5, 10) of 9 tokens (prompt 4: logits 3 .. 7)
    assert cp_utils.get_logits_and_tokens_offset_with_cp(9, 5) == (5, ((0, 5), (5, 10)), ((3, 5), (5, 8)),
                                                                    ((4, 6), (6, 9)))
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]
    per_sample = cp_utils.get_sum_of_sample_mean([5, 4], [3, 2], masks)
    assert per_sample(values).item() == pytest.approx((1 + 2) / 2 + (4 + 5) / 2)
    per_rollout = cp_utils.get_sum_of_sample_mean([5, 4], [3, 2], masks, torch.tensor([4.0, 4.0]))
    assert per_rollout(values).item() == pytest.approx((1 + 2 + 4 + 5) / 4)
    per_token = cp_utils.get_sum_of_sample_mean([5, 4], [3, 2], masks, calculate_per_token_loss=True)
    assert per_token(values).item() == pytest.approx(12.0)
    with pytest.raises(ValueError, match="4 values, but the micro-batch's samples hold 5 response tokens"):
        per_token(values[:4])


# one sample of 8 tokens, 6 of them response (prompt 2), over CP 2: chunks of 2 tokens; rank 0 holds positions
# [0, 2) and [6, 8), rank 1 [2, 4) and [4, 6); the response token t is predicted at position 1 + t, so rank 0
# holds response tokens {0, 5} and rank 1 {1, 2, 3, 4}
FULL = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0])
HELD = {0: [0, 5], 1: [1, 2, 3, 4]}
OFFSETS = {0: (2, ((0, 2), (6, 8)), ((1, 2), (6, 7)), ((2, 3), (7, 8))),
           1: (2, ((2, 4), (4, 6)), ((2, 4), (4, 6)), ((3, 5), (5, 7)))}


def _cp_worker(rank: int, store: str, template: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from slime.observability.train_data_utils import save_debug_train_data

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        assert cp_utils.cp_size_and_rank() == (2, rank)
        assert cp_utils.get_logits_and_tokens_offset_with_cp(8, 6) == OFFSETS[rank]
        local = cp_utils.slice_log_prob_with_cp(FULL, 8, 6)
        assert local.tolist() == FULL[HELD[rank]].tolist()
        assert cp_utils.slice_log_prob_with_cp(FULL.tolist(), 8, 6) == FULL[HELD[rank]].tolist()
        assert cp_utils.slice_with_cp(torch.arange(7), -1).tolist() == ([0, 1, 6, -1] if rank == 0 else [2, 3, 4, 5])

        local = local.clone().requires_grad_()
        gathered = cp_utils.all_gather_with_cp(local, 8, 6)
        assert gathered.tolist() == FULL.tolist()
        gathered.sum().backward()  # the backward is collective too: every rank's part gets its gradient
        assert local.grad.tolist() == [2.0] * len(HELD[rank])

        mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
        share = cp_utils.get_sum_of_sample_mean([8], [6], [mask])(local.detach())
        dist.all_reduce(share)
        assert share.item() == pytest.approx((0.5 + 1.0 + 2.0 + 2.5 + 3.0) / 5)

        data = {"partition": [0], "total_lengths": [8], "response_lengths": [6], "loss_masks": [mask],
                "log_probs": [local.detach()]}
        written = save_debug_train_data(SimpleNamespace(save_debug_train_data=template), rollout_id=2,
                                        rollout_data=data)
        assert (written is not None) == (rank == 0)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_context_parallel_layout_over_megatron_cp_groups(tmp_path):
    import torch.multiprocessing as mp

    template = str(tmp_path / "train_{rollout_id}_{rank}.pt")
    fork_context("megatron.core.parallel_state", __name__)  # tests/forkserver.py: imported once, not per rank
    mp.start_processes(_cp_worker, args=(str(tmp_path / "store"), template), nprocs=2, start_method="forkserver")

    saved = torch.load(tmp_path / "train_2_0.pt", weights_only=True)
    assert [p.name for p in tmp_path.glob("train_*")] == ["train_2_0.pt"]  # CP rank 1 only helped restore
    assert saved["samples"][0]["log_probs"].tolist() == FULL.tolist()
    assert saved["samples"][0]["loss_masks"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
