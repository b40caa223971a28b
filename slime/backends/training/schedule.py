"""`build_dp_schedule`, slime's call (re-exported at slime's path `slime.utils.dp_schedule`): one rollout's whole
training schedule (which data-parallel rank trains which rows, in which micro-batches, in how many optimizer
steps), computed by the batching the trainers use (slime/backends/training/batching.py), so a script that plans
with slime's call gets this implementation's plan:

1. steps of `global_batch_size` rollouts, the rows sharing a rollout id in one step (`step_rows`);
2. each rank's share of a step (`rows_per_step`): contiguous, or with `--balance-data` shares of close token
   counts (greedy, longest row first);
3. each share in micro-batches of `--micro-batch-size` rows, or with `--use-dynamic-batch-size` of consecutive
   rows summing to at most `--max-tokens-per-gpu × cp_size` tokens (a longer row alone);
4. every rank then cut (`split_into`) to the largest count of the step, rounded up to a multiple of
   `microbatch_group_size_per_vp_stage` with virtual pipeline stages: the ranks' forwards run in lockstep.

Where slime differs: slime packs a step first-fit and hands micro-batches to ranks (Karmarkar-Karp on estimated
FLOPs with `--balance-data`), and drops trailing rollouts that do not fill a step; here a rollout count that is
not a multiple of `global_batch_size` is an error naming the flags.
"""

from __future__ import annotations

from typing import Any

from slime.backends.training.batching import rows_per_step, split_by_tokens, split_into, split_micro_batches


Schedule = tuple[list[list[int]], list[list[list[int]]], list[int], list[int]]


def build_dp_schedule(args: Any, train_parallel_config: dict, total_lengths: list[int], *, global_batch_size: int,
                      rollout_indices: list[int]) -> Schedule:
    """`(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)`, slime's shapes: `partitions[r]`
    the rows (indices into `total_lengths`) rank r trains, step after step; `micro_batch_indices[r]` its
    micro-batches as indices into `partitions[r]`; `num_microbatches[s]` the micro-batches every rank runs in
    step s; `global_batch_sizes[s]` the rollouts of step s. `train_parallel_config` holds `dp_size`, `cp_size`,
    `vpp_size`, `microbatch_group_size_per_vp_stage`; `rollout_indices[i]` is row i's rollout id."""
    dp_size, cp_size = train_parallel_config["dp_size"], train_parallel_config["cp_size"]
    multiple = 1
    if train_parallel_config["vpp_size"] > 1:
        multiple = train_parallel_config["microbatch_group_size_per_vp_stage"]
    lengths = list(total_lengths)
    shares = [rows_per_step(len(lengths), global_batch_size, dp_size, rank, lengths if args.balance_data else None,
                            rollout_indices) for rank in range(dp_size)]
    partitions: list[list[int]] = [[] for _ in range(dp_size)]
    micro_batch_indices: list[list[list[int]]] = [[] for _ in range(dp_size)]
    num_microbatches = []
    for step in range(len(shares[0])):
        groups = [_micro_batches(args, shares[rank][step], lengths, cp_size) for rank in range(dp_size)]
        count = -(-max(len(g) for g in groups) // multiple) * multiple
        for rank in range(dp_size):
            rows = shares[rank][step]
            for group in split_into(rows, [lengths[r] for r in rows], groups[rank], count):
                start = len(partitions[rank])
                partitions[rank].extend(group)
                micro_batch_indices[rank].append(list(range(start, start + len(group))))
        num_microbatches.append(count)
    return partitions, micro_batch_indices, num_microbatches, [global_batch_size] * len(num_microbatches)


def _micro_batches(args: Any, rows: list[int], lengths: list[int], cp_size: int) -> list[list[int]]:
    if not args.use_dynamic_batch_size:
        return split_micro_batches(rows, args.micro_batch_size)
    budget = None if args.max_tokens_per_gpu is None else args.max_tokens_per_gpu * cp_size
    return split_by_tokens(rows, [lengths[r] for r in rows], budget, packed=True)
