"""Context parallelism (`--context-parallel-size` > 1) of packed micro-batches: which tokens a CP rank holds, and
the gathers across the CP group that attention and the log-probs need.

The layout is the zigzag split of slime/observability/context_parallel.py, applied to every sequence of a packed
`[1, T]` row: each sequence (the trailing pad sequence of a packed micro-batch included) is right-padded with
pad tokens to a multiple of `2 × cp`, cut into `2 × cp` chunks, and CP rank r holds chunks r and `2 × cp − 1 − r`
of every sequence, sequence after sequence. The padded row has the boundaries `padded_cu`; a rank holds
`padded_cu[-1] / cp` tokens, as many as every other rank.

What the forward does with it (forward.py, sdpa_attention.py):
- each rank embeds its own tokens only; rotary embeddings use each token's position within its own sequence
  (packed_rope.py reads it from this layout, given `padded_cu` as the packed row's boundaries, which is also
  how megatron-core's own THD rotary under CP reads a zigzag row);
- attention gathers every rank's keys and values (`gather_cp`) and lets a query see the keys of its sequence at
  positions up to its own; the pad tokens of a sequence sit after its real tokens, so no real token sees them;
- the per-position log-probs / entropies of a rank's tokens are gathered into the padded row and read back at
  the original positions, so the loss sees whole sequences, the same values on every CP rank.

Gradients: each rank computes the same loss from the gathered values. The log-prob gather hands each rank the
gradient of its own positions only (it is the same on every rank), so the gradients of a replica's CP ranks add
up to the gradient without CP; megatron-core's schedule multiplies the loss by the CP size and its DDP averages
over the data-parallel-with-CP group, which cancel. The key/value gather sums the gradients of every rank's
queries back to the rank that owns the key.

Simplified: attention runs one SDPA call per sequence with an explicit mask over the whole gathered sequence (no
ring exchange, no fused varlen kernel), and log-probs are computed for every token a rank holds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime.observability.context_parallel import parallel_state


def cp_group_size_rank() -> tuple[int, int, object | None]:
    """(CP size, CP rank, CP group) of megatron-core's parallel state; (1, 0, None) without it."""
    mpu = parallel_state()
    if mpu is None or mpu.get_context_parallel_world_size() == 1:
        return 1, 0, None
    return mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(), mpu.get_context_parallel_group()


def padded_boundaries(cu_seqlens: list[int], cp_size: int) -> list[int]:
    """Sequence boundaries after padding every sequence to a multiple of `2 × cp_size` tokens."""
    multiple = 2 * cp_size
    padded = [0]
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        padded.append(padded[-1] + -(-(end - start) // multiple) * multiple)
    return padded


@dataclass(frozen=True)
class ZigzagLayout:
    """One CP rank's share of a packed row whose sequences have the (padded) boundaries `padded_cu`.

    - `local_index` [T_pad / cp]: the padded-row position of each token this rank holds, in its order;
    - `local_positions` [T_pad / cp]: each of those tokens' position within its own sequence;
    - `local_cu`: the boundaries of each sequence's tokens within this rank's tokens;
    - `gather_order` [T_pad]: for each padded-row position, its index in the concatenation of every rank's
      tokens, rank after rank (what `gather_cp` returns)."""

    padded_cu: tuple[int, ...]
    local_index: torch.Tensor
    local_positions: torch.Tensor
    local_cu: tuple[int, ...]
    gather_order: torch.Tensor


@functools.lru_cache(maxsize=16)
def zigzag_layout(padded_cu: tuple[int, ...], cp_size: int, cp_rank: int, device: str) -> ZigzagLayout:
    """The layout of `padded_cu` (every length a multiple of `2 × cp_size`) on CP rank `cp_rank`; cached, since
    every attention layer of a forward asks for it."""
    starts = torch.tensor(padded_cu[:-1], dtype=torch.long)
    lengths = torch.tensor(padded_cu[1:], dtype=torch.long) - starts
    if bool((lengths % (2 * cp_size)).any()):
        raise ValueError(f"zigzag_layout: sequence lengths {lengths.tolist()} are not multiples of 2 × cp = "
                         f"{2 * cp_size}; pad them with padded_boundaries first")
    total = padded_cu[-1]
    per_rank = total // cp_size
    chunk = lengths // (2 * cp_size)
    # every padded position: its sequence, its position in it, its chunk, and which rank holds it where
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=total)
    pos = torch.arange(total) - starts[seq]
    k = pos // chunk[seq]
    owner = torch.where(k < cp_size, k, 2 * cp_size - 1 - k)
    within = starts[seq] // cp_size + torch.where(k < cp_size, 0, chunk[seq]) + pos % chunk[seq]
    gather_order = owner * per_rank + within
    mine = torch.nonzero(owner == cp_rank).squeeze(1)
    local_index = torch.empty(per_rank, dtype=torch.long)
    local_index[within[mine]] = mine
    local_cu = tuple(start // cp_size for start in padded_cu)
    return ZigzagLayout(padded_cu=tuple(padded_cu), local_index=local_index.to(device),
                        local_positions=pos[local_index].to(device), local_cu=local_cu,
                        gather_order=gather_order.to(device))


def pad_row(ids: torch.Tensor, cu_seqlens: list[int], padded_cu: list[int] | tuple[int, ...], pad_value=0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed row's values `[T, ...]` -> (`[T_pad, ...]` with each sequence padded by `pad_value`, the padded
    position of every original position `[T]`)."""
    original = torch.cat([torch.arange(end - start) + padded
                          for start, end, padded in zip(cu_seqlens[:-1], cu_seqlens[1:], padded_cu[:-1])])
    original = original.to(ids.device)
    out = torch.full((padded_cu[-1], *ids.shape[1:]), pad_value, dtype=ids.dtype, device=ids.device)
    out[original] = ids
    return out, original


class _GatherCP(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward: the sum over the group of the gradients of this rank's
    rows (`sum_grad`), or this rank's rows of its own gradient (when every rank's gradient is the same)."""

    @staticmethod
    def forward(ctx, x, group, sum_grad):
        ctx.group, ctx.sum_grad = group, sum_grad
        ctx.rank, ctx.size, ctx.rows = dist.get_rank(group), dist.get_world_size(group), x.shape[0]
        pieces = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.sum_grad:
            if dist.get_backend(ctx.group) == "nccl":
                out = torch.empty((ctx.rows, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
                dist.reduce_scatter_tensor(out, grad, group=ctx.group)
                return out, None, None
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows].clone(), None, None


def gather_cp(x: torch.Tensor, group, sum_grad: bool) -> torch.Tensor:
    """Every CP rank's `x` (equal shapes), rank after rank along dim 0; differentiable (see `_GatherCP`)."""
    return _GatherCP.apply(x, group, sum_grad)
