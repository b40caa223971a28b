"""`slime.observability`: the `--save-debug-train-data` dump (its payload, the context-parallel restore, the
file written without megatron and over a real gloo group) and the top-p rollout metric."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slime.observability.rollout_metrics import top_p_kept_vocab_metrics
from slime.observability.train_data_utils import (
    _build_dump_payload,
    restore_context_parallel_fields_to_cpu,
    save_debug_train_data,
)
from slime.utils.types import Sample
from tests.forkserver import fork_context


def _shard(rank, dp_rank, partition, log_probs, **extra):
    return {"rank": rank, "data_parallel_rank": dp_rank,
            "rollout_data": {"partition": partition, "response_lengths": [len(x) for x in log_probs],
                             "log_probs": log_probs, **extra}}


def test_payload_lines_samples_up_with_the_rollout_and_keeps_each_ranks_layout():
    shards = [
        _shard(0, 0, [3, 0], [torch.tensor([3.0]), torch.tensor([0.0, 0.5])], raw_reward=[1.0, 0.0, 1.0, 0.0],
               micro_batch_indices=[[0], [1]], rewards=[0.3, 0.0]),
        _shard(2, 1, [1, 2], [torch.tensor([1.0]), torch.tensor([2.0])], raw_reward=[1.0, 0.0, 1.0, 0.0],
               micro_batch_indices=[[0, 1]], rewards=[0.1, 0.2]),
    ]
    payload = _build_dump_payload(shards, rollout_id=4, writer_rank=0)

    assert set(payload) == {"format_version", "rollout_id", "rank", "samples", "dp_shards", "raw_reward"}
    assert (payload["format_version"], payload["rollout_id"], payload["rank"]) == (2, 4, 0)
    assert payload["raw_reward"] == [1.0, 0.0, 1.0, 0.0]  # the whole batch's, once
    samples = payload["samples"]
    assert [s["rollout_position"] for s in samples] == [0, 1, 2, 3]
    assert [s["data_parallel_rank"] for s in samples] == [0, 1, 1, 0]
    assert [s["rewards"] for s in samples] == [0.0, 0.1, 0.2, 0.3]
    assert samples[0]["log_probs"].tolist() == [0.0, 0.5] and samples[0]["response_lengths"] == 2
    assert "micro_batch_indices" not in samples[0]
    assert [(d["rank"], d["partition"], d["micro_batch_indices"]) for d in payload["dp_shards"]] == [
        (0, [3, 0], [[0], [1]]), (2, [1, 2], [[0, 1]])]
    assert "log_probs" not in payload["dp_shards"][0]


def test_payload_without_row_ids_keeps_gather_order(caplog):
    shard = {"rank": 0, "data_parallel_rank": 0,
             "rollout_data": {"response_lengths": [1, 1], "log_probs": [torch.tensor([5.0]), torch.tensor([4.0])]}}
    payload = _build_dump_payload([shard], rollout_id=1, writer_rank=0)
    assert [s["log_probs"].item() for s in payload["samples"]] == [5.0, 4.0]
    assert "rollout_position" not in payload["samples"][0]
    assert "gather order" in caplog.text


def test_cp_restore_gathers_each_sample_and_copies_to_the_cpu():
    calls = []

    def gather(value, total, response):
        calls.append((value.tolist(), total, response))
        return torch.full((response,), float(total))

    data = {"total_lengths": [5, 7], "response_lengths": [2, 3], "loss_masks": [torch.ones(2), torch.ones(3)],
            "log_probs": [torch.tensor([0.5]), torch.tensor([0.25, 0.75])],
            "advantages": [torch.tensor([1.0]), torch.tensor([2.0, 3.0])]}
    restored = restore_context_parallel_fields_to_cpu(data, gather, keep_restored=True)

    assert calls == [([0.5], 5, 2), ([0.25, 0.75], 7, 3), ([1.0], 5, 2), ([2.0, 3.0], 7, 3)]
    assert [x.tolist() for x in restored["log_probs"]] == [[5.0, 5.0], [7.0, 7.0, 7.0]]
    assert restored["loss_masks"][1].tolist() == [1.0, 1.0, 1.0]
    assert restored["loss_masks"][1] is not data["loss_masks"][1]
    assert data["log_probs"][0].tolist() == [0.5]  # the caller's dict is left alone
    # a rank that does not keep the copy still runs every gather (they are collective) and gets None
    calls.clear()
    assert restore_context_parallel_fields_to_cpu(data, gather, keep_restored=False) is None
    assert len(calls) == 4


@pytest.mark.parametrize("data, error, match", [
    ({"total_lengths": [5], "response_lengths": [2, 3]}, ValueError, "1 total_lengths but 2 response_lengths"),
    ({"total_lengths": [5, 7], "response_lengths": [2, 3], "log_probs": [torch.ones(2)]}, ValueError,
     r"rollout_data\['log_probs'\] must hold one tensor per sample: got 1, expected 2"),
    ({"total_lengths": [5], "response_lengths": [2], "values": [[0.0, 1.0]]}, TypeError,
     r"rollout_data\['values'\]\[0\] must be a tensor, got list"),
])
def test_cp_restore_names_the_misaligned_field(data, error, match):
    with pytest.raises(error, match=match):
        restore_context_parallel_fields_to_cpu(data, lambda v, t, r: v, keep_restored=True)


def test_cp_restore_checks_the_restored_length():
    data = {"total_lengths": [5], "response_lengths": [2], "log_probs": [torch.ones(1)]}
    with pytest.raises(ValueError, match=r"restored to 1 values; the sample has response_length 2"):
        restore_context_parallel_fields_to_cpu(data, lambda v, t, r: v, keep_restored=True)


def _rollout_data(offset: float):
    return {"partition": [1, 0], "tokens": [torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
            "total_lengths": [3, 2], "response_lengths": [2, 1], "raw_reward": [1.0, 0.0],
            "log_probs": [torch.tensor([-0.5, -0.25], requires_grad=True) + offset, torch.tensor([-1.0]) + offset]}


def test_dump_without_megatron_or_torch_distributed_writes_one_file(tmp_path):
    args = SimpleNamespace(save_debug_train_data=str(tmp_path / "train" / "{rollout_id}_{rank}.pt"))
    path = save_debug_train_data(args, rollout_id=3, rollout_data=_rollout_data(0.0))

    assert path == str(tmp_path / "train" / "3_0.pt")
    saved = torch.load(path, weights_only=True)
    assert [s["rollout_position"] for s in saved["samples"]] == [0, 1]
    assert saved["samples"][1]["log_probs"].tolist() == [-0.5, -0.25]
    assert not saved["samples"][1]["log_probs"].requires_grad
    assert saved["raw_reward"] == [1.0, 0.0]
    assert save_debug_train_data(SimpleNamespace(save_debug_train_data=None), rollout_id=3,
                                 rollout_data=_rollout_data(0.0)) is None


def _dump_worker(rank: int, store: str, template: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        data = _rollout_data(10.0 * rank)
        data["partition"] = [2 * rank + 1, 2 * rank]  # rank 0 trained rows 1, 0; rank 1 rows 3, 2
        written = save_debug_train_data(SimpleNamespace(save_debug_train_data=template), rollout_id=7,
                                        rollout_data=data)
        assert (written is not None) == (rank == 0)
    finally:
        dist.destroy_process_group()


def test_dump_gathers_the_data_parallel_ranks_on_rank_0(tmp_path):
    """Over a real gloo group (the fsdp backend's layout: every rank data-parallel): one file, by rank 0, with
    every rank's rows in rollout order."""
    import torch.multiprocessing as mp

    template = str(tmp_path / "train_{rollout_id}.pt")
    fork_context(__name__)  # tests/forkserver.py: the ranks fork from a server that imported torch once
    mp.start_processes(_dump_worker, args=(str(tmp_path / "store"), template), nprocs=2, start_method="forkserver")

    saved = torch.load(tmp_path / "train_7.pt", weights_only=True)
    assert [p.name for p in tmp_path.glob("train_*")] == ["train_7.pt"]
    assert [s["rollout_position"] for s in saved["samples"]] == [0, 1, 2, 3]
    assert [s["data_parallel_rank"] for s in saved["samples"]] == [0, 0, 1, 1]
    assert [s["log_probs"].tolist() for s in saved["samples"]] == [[-1.0], [-0.5, -0.25], [9.0], [9.5, 9.75]]
    assert [d["partition"] for d in saved["dp_shards"]] == [[1, 0], [3, 2]]


def test_top_p_kept_vocab_is_a_mean_over_loss_masked_tokens():
    samples = [
        # widths 2, 3, 1: with mask [1, 0, 1] → 2 + 1 over 2 tokens
        Sample(index=0, response_length=3, loss_mask=[1, 0, 1], rollout_top_p_token_offsets=[0, 2, 5, 6]),
        # no loss mask: every token, widths 4 + 4 over 2 tokens
        Sample(index=1, response_length=2, rollout_top_p_token_offsets=torch.tensor([0, 4, 8])),
        Sample(index=2, response_length=1, remove_sample=True, rollout_top_p_token_offsets=[0, 100]),
        Sample(index=3, response_length=2),  # no nucleus reported
    ]
    assert top_p_kept_vocab_metrics(samples) == {"top_p_kept_vocab_per_token": pytest.approx(11 / 4)}
    assert top_p_kept_vocab_metrics(samples[2:]) == {}
    bad = Sample(index=9, response_length=3, rollout_top_p_token_offsets=[0, 1, 2])
    with pytest.raises(ValueError, match="sample 9: 3 rollout_top_p_token_offsets for response_length 3"):
        top_p_kept_vocab_metrics([bad])
