"""`--save-debug-train-data PATH`: what each rollout's training saw, in one file per rollout (slime's format,
`format_version` 2), for post-hoc analysis next to the rollout dump of `--save-debug-rollout-data`.

`save_debug_train_data(args, rollout_id=, rollout_data=)` is called by every training rank after the rollout's
optimizer steps, with its rows' slime `rollout_data` dict (tokens, response / total lengths, loss masks,
rewards, the log-probs, advantages, returns, ... it trained with; `partition`: the rows' positions in the
rollout; `raw_reward`: the whole batch's). It is collective:

1. only the ranks that hold the computed values take part: the last pipeline stage, tensor-parallel rank 0;
2. per-token values a context-parallel rank holds only its chunks of are made whole (`all_gather_with_cp`,
   slime/observability/context_parallel.py) and copied to the CPU, one tensor at a time, kept on CP rank 0;
3. the data-parallel ranks' shards are gathered (`gather_object`) on the data-parallel source rank, which
   writes `PATH.format(rollout_id=, rank=)`.

The file holds `{"format_version": 2, "rollout_id", "rank" (the writer's), "samples", "dp_shards", and the
whole-batch fields}`. `samples` has one dict per trained row with its per-row values and the
`data_parallel_rank` that trained it, sorted by `rollout_position` (`partition`) so that it lines up with the
rollout dump's samples (else by `sample_index`, else in gather order, with a warning); `dp_shards` keeps each
rank's scheduling (its `partition` / `sample_indices`, micro-batches, ...) without repeating any per-row tensor.

The parallel layout is megatron-core's when a megatron trainer set it up in this process; otherwise (the fsdp
backend) every rank of torch.distributed is a data-parallel rank holding whole values, and rank 0 writes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slime.observability import context_parallel

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2

# per-token values a context-parallel rank holds only its chunks of (in this order they are restored)
CP_SHARDED_FIELDS = ("rollout_log_probs", "teacher_log_probs", "log_probs", "ref_log_probs", "values", "advantages",
                     "returns", "kl", "entropy", "opd_reverse_kl")
# a rank's scheduling, kept per shard rather than per sample
LAYOUT_FIELDS = ("micro_batch_indices", "num_microbatches", "global_batch_sizes")
# the same on every shard: stored once, at the top of the file
WHOLE_BATCH_FIELDS = ("raw_reward",)
# per-row ids lifted onto each sample dict under their own name
ID_FIELDS = {"partition": "rollout_position", "sample_indices": "sample_index"}


def _cpu_copy(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v) for v in value)
    return value


@torch.no_grad()
def restore_context_parallel_fields_to_cpu(rollout_data: dict[str, Any],
                                           gather_tensor: Callable[[torch.Tensor, int, int], torch.Tensor], *,
                                           keep_restored: bool) -> dict[str, Any] | None:
    """CPU copies of `rollout_data` with each `CP_SHARDED_FIELDS` value made whole by `gather_tensor(value,
    total_length, response_length)`, one sample at a time (so at most one whole tensor is on the device at
    once). Every CP rank must call it (the gathers are collective); only a rank with `keep_restored` builds the
    copy, the others get None. `rollout_data` itself is left as it was."""
    total_lengths, response_lengths = rollout_data["total_lengths"], rollout_data["response_lengths"]
    count = len(response_lengths)
    if len(total_lengths) != count:
        raise ValueError(f"rollout_data has {len(total_lengths)} total_lengths but {count} response_lengths; "
                         "both need one entry per sample")
    restored = None
    if keep_restored:
        restored = {k: _cpu_copy(v) for k, v in rollout_data.items() if k not in CP_SHARDED_FIELDS}
    for key in CP_SHARDED_FIELDS:
        values = rollout_data.get(key)
        if values is None:
            continue
        if not isinstance(values, (list, tuple)) or len(values) != count:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(f"rollout_data[{key!r}] must hold one tensor per sample: got {got}, expected {count}")
        whole = []
        for i, (value, total, n) in enumerate(zip(values, total_lengths, response_lengths)):
            if not torch.is_tensor(value):
                raise TypeError(f"rollout_data[{key!r}][{i}] must be a tensor, got {type(value).__name__}")
            full = gather_tensor(value, int(total), int(n))
            if full.shape[0] != n:
                raise ValueError(f"rollout_data[{key!r}][{i}] restored to {full.shape[0]} values; the sample has "
                                 f"response_length {n}")
            if keep_restored:
                whole.append(full.detach().to("cpu", copy=True))
            del full
        if restored is not None:
            restored[key] = whole
    return restored


def _is_per_sample(value: Any, count: int) -> bool:
    if torch.is_tensor(value):
        return value.dim() >= 1 and value.shape[0] == count
    return isinstance(value, (list, tuple)) and len(value) == count


def _build_dump_payload(dp_shards: list[dict[str, Any]], *, rollout_id: int, writer_rank: int) -> dict[str, Any]:
    """The file's content from the gathered shards `{"rank", "data_parallel_rank", "rollout_data"}` (module
    docstring)."""
    samples: list[dict[str, Any]] = []
    layout: list[dict[str, Any]] = []
    whole_batch: dict[str, Any] = {}
    for shard in dp_shards:
        data, dp_rank = shard["rollout_data"], shard["data_parallel_rank"]
        count = len(data["response_lengths"])
        entry: dict[str, Any] = {"rank": shard["rank"], "data_parallel_rank": dp_rank}
        for key in ID_FIELDS:
            entry[key] = None if data.get(key) is None else list(data[key])
        columns = {}
        for key, value in data.items():
            if key in ID_FIELDS:
                continue
            if key in WHOLE_BATCH_FIELDS:
                whole_batch.setdefault(key, value)
            elif key in LAYOUT_FIELDS or not _is_per_sample(value, count):
                entry[key] = value
            else:
                columns[key] = value
        for i in range(count):
            sample: dict[str, Any] = {"data_parallel_rank": dp_rank}
            for key, name in ID_FIELDS.items():
                if entry[key] is not None:
                    sample[name] = entry[key][i]
            sample.update({key: column[i] for key, column in columns.items()})
            samples.append(sample)
        layout.append(entry)

    order = next((name for name in ("rollout_position", "sample_index")
                  if samples and all(s.get(name) is not None for s in samples)), None)
    if order is None:
        logger.warning("--save-debug-train-data: the rows carry neither partition nor sample_indices, so the train "
                       "dump of rollout %d keeps them in gather order (not the rollout dump's)", rollout_id)
    else:
        samples.sort(key=lambda s: s[order])
    return {"format_version": FORMAT_VERSION, "rollout_id": rollout_id, "rank": writer_rank, "samples": samples,
            "dp_shards": layout, **whole_batch}


@dataclass
class _Layout:
    """Where this rank sits for the dump."""

    rank: int
    holds_values: bool  # last pipeline stage and tensor-parallel rank 0
    cp_rank: int
    dp_rank: int
    dp_size: int
    dp_src: int  # global rank of the data-parallel group's first rank: the writer
    dp_group: Callable[[], Any]  # the (CPU-capable) data-parallel group, asked for only when gathering


def _layout() -> _Layout:
    mpu = context_parallel.parallel_state()
    if mpu is None:
        on = dist.is_initialized()
        return _Layout(rank=dist.get_rank() if on else 0, holds_values=True, cp_rank=0,
                       dp_rank=dist.get_rank() if on else 0, dp_size=dist.get_world_size() if on else 1, dp_src=0,
                       dp_group=lambda: None)
    return _Layout(
        rank=dist.get_rank(),
        holds_values=mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0,
        cp_rank=mpu.get_context_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(with_context_parallel=False),
        dp_size=mpu.get_data_parallel_world_size(with_context_parallel=False),
        dp_src=mpu.get_data_parallel_src_rank(with_context_parallel=False),
        dp_group=lambda: mpu.get_data_parallel_group_gloo(with_context_parallel=False),
    )


def save_debug_train_data(args: Any, *, rollout_id: int, rollout_data: dict[str, Any]) -> str | None:
    """`--save-debug-train-data`: write this rollout's train data (module docstring). Collective over the ranks
    that hold the computed values; returns the path on the rank that wrote it, else None."""
    template = args.save_debug_train_data
    if template is None:
        return None
    where = _layout()
    if not where.holds_values:
        return None
    restored = restore_context_parallel_fields_to_cpu(rollout_data, context_parallel.all_gather_with_cp,
                                                      keep_restored=where.cp_rank == 0)
    if where.cp_rank != 0:
        return None
    shard = {"rank": where.rank, "data_parallel_rank": where.dp_rank, "rollout_data": restored}
    shards: list[Any] | None = [shard]
    if where.dp_size > 1:
        shards = [None] * where.dp_size if where.rank == where.dp_src else None
        dist.gather_object(shard, shards, dst=where.dp_src, group=where.dp_group())
    if where.rank != where.dp_src:
        return None
    path = template.format(rollout_id=rollout_id, rank=where.rank)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(_build_dump_payload(shards, rollout_id=rollout_id, writer_rank=where.rank), path)
    logger.info("rollout %d: train data of %d data-parallel shard(s) saved to %s", rollout_id, len(shards), path)
    return path
