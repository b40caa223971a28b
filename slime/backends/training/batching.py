"""Backend-agnostic batch plumbing shared by the `fsdp` and `megatron` backends: which rows a data-parallel
rank trains on, fixed-size or token-budget micro-batches, right padding or packing, and per-token value
(un)padding.

Steps count rollouts: `--global-batch-size` rollouts per optimizer step, the rows a custom generate
split from one rollout kept in one step (`step_rows`), and in the per-sample mean each row's token sum divided
by its rollout's loss-masked tokens (`rollout_mask_sums`), so each rollout weighs as one sample.

Right padding keeps every real token's position id and causal context unchanged, so a padded row computes
the same log-probs as the row alone; a causal attention mask alone is then enough for the real tokens.
Packing (the megatron backend's `--qkv-format thd`) puts the sequences back to back in one row; the model
is told their boundaries (`cu_seqlens`) so that each attends only to itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


# ---- which rows -------------------------------------------------------------------------------------------
def step_rows(num_rows: int, global_batch_size: int, rollout_ids: Sequence[int] | None = None) -> list[list[int]]:
    """The rows of every optimizer step (all ranks'): a step is `global_batch_size`
    rollouts, and the rows split from one rollout (those sharing a `rollout_ids` entry; None: every row is a
    rollout) stay in one step, rollouts in order of first appearance. With one row per rollout, step s is rows
    [s·gbs, (s+1)·gbs)."""
    ids = list(range(num_rows)) if rollout_ids is None else list(rollout_ids)
    if len(ids) != num_rows:
        raise ValueError(f"{len(ids)} rollout ids for a train batch of {num_rows} samples")
    rows_of: dict[int, list[int]] = {}
    for row, rid in enumerate(ids):
        rows_of.setdefault(rid, []).append(row)
    rollouts = list(rows_of)
    if global_batch_size <= 0 or len(rollouts) % global_batch_size != 0:
        split = f" (in {num_rows} samples)" if num_rows != len(rollouts) else ""
        raise ValueError(
            f"the train batch has {len(rollouts)} rollouts{split}, which is not a multiple of --global-batch-size "
            f"{global_batch_size}; make --rollout-batch-size × --n-samples-per-prompt a multiple of it"
        )
    return [[row for rid in rollouts[s : s + global_batch_size] for row in rows_of[rid]]
            for s in range(0, len(rollouts), global_batch_size)]


def run_optimizer_steps(args, num_rollout: int | None) -> int:
    """Optimizer steps of the whole run, the learning-rate schedule's horizon: rollouts × steps per rollout
    (`--num-rollout`, or the count resolved from `--num-epoch`, passed as `num_rollout`)."""
    per_rollout = max(1, args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size)
    return max(1, (num_rollout or 1) * per_rollout)


def rows_per_step(num_rows: int, global_batch_size: int, world_size: int, rank: int,
                  lengths: Sequence[int] | None = None, rollout_ids: Sequence[int] | None = None) -> list[list[int]]:
    """Row indices this rank trains on, one list per optimizer step (`step_rows`).

    Each rank takes 1/world_size of a step's rows: a contiguous share, or with `lengths` (`--balance-data`) the
    share `balanced_shares` gives it, so that the ranks' token counts are close. When rollouts were split into
    several rows the step's rows may not divide evenly: shares then differ by one row."""
    if global_batch_size % world_size != 0:
        raise ValueError(
            f"--global-batch-size {global_batch_size} is not divisible by the {world_size} training ranks; "
            f"use a multiple of {world_size}"
        )
    out = []
    for rows in step_rows(num_rows, global_batch_size, rollout_ids):
        if lengths is None:
            sizes = share_sizes(len(rows), world_size)
            start = sum(sizes[:rank])
            out.append(rows[start : start + sizes[rank]])
        else:
            out.append(balanced_shares(rows, [lengths[r] for r in rows], world_size)[rank])
    return out


def share_sizes(count: int, parts: int) -> list[int]:
    """`count` items over `parts` shares as evenly as possible: the first `count % parts` take one more."""
    return [count // parts + (i < count % parts) for i in range(parts)]


def balanced_shares(rows: Sequence[int], lengths: Sequence[int], parts: int) -> list[list[int]]:
    """`rows` split into `parts` shares of `share_sizes` whose token sums are close (`--balance-data`): longest
    row first, each to the share with the fewest tokens that still has room (greedy LPT). Every rank computes the
    same split from the same lengths; each share keeps row order."""
    sizes = share_sizes(len(rows), parts)
    shares: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for r, n in sorted(zip(rows, lengths), key=lambda rn: (-rn[1], rn[0])):
        i = min((i for i in range(parts) if len(shares[i]) < sizes[i]), key=lambda i: (tokens[i], i))
        shares[i].append(r)
        tokens[i] += n
    return [sorted(share) for share in shares]


def rollout_mask_sums(loss_masks: Sequence[Sequence[int]], rollout_ids: Sequence[int]) -> list[float]:
    """Per row, the loss-masked tokens of its whole rollout (slime's `rollout_mask_sums`): what a row's masked
    token sum is divided by in the per-sample mean, so the rows split from one rollout together give one
    token mean per rollout (a rollout of one row: the row's own token mean)."""
    total: dict[int, float] = {}
    for mask, rid in zip(loss_masks, rollout_ids):
        total[rid] = total.get(rid, 0.0) + float(sum(mask))
    return [total[rid] for rid in rollout_ids]


def split_micro_batches(rows: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size {micro_batch_size}: must be >= 1")
    return [list(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]


def split_by_tokens(rows: Sequence[int], lengths: Sequence[int], max_tokens: int | None,
                    packed: bool = False) -> list[list[int]]:
    """--use-dynamic-batch-size: consecutive rows grouped so that each micro-batch holds at most `max_tokens`
    tokens: padded (rows × longest row), or with `packed` the rows' own tokens summed; a row longer than
    that forms a micro-batch of its own."""
    if not max_tokens or max_tokens <= 0:
        raise ValueError(f"--use-dynamic-batch-size needs --max-tokens-per-gpu > 0 (got {max_tokens})")
    out: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for r, n in zip(rows, lengths):
        size = total + n if packed else (len(current) + 1) * max(longest, n)
        if current and size > max_tokens:
            out.append(current)
            current, longest, total = [], 0, 0
        current.append(r)
        longest = max(longest, n)
        total += n
    if current:
        out.append(current)
    return out


def split_into(rows: Sequence[int], lengths: Sequence[int], groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` (a split of `rows`) cut further until there are `count` micro-batches: the one with the most
    padded tokens is halved each time. Ranks whose forwards meet in collectives (expert parallelism) need
    the same number of micro-batches."""
    if count > len(rows):
        raise ValueError(f"cannot make {count} micro-batches of {len(rows)} rows")
    length = dict(zip(rows, lengths))
    groups = [list(g) for g in groups]
    while len(groups) < count:
        i = max((i for i, g in enumerate(groups) if len(g) > 1),
                key=lambda i: len(groups[i]) * max(length[r] for r in groups[i]))
        g = groups[i]
        groups[i : i + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups


def plan_micro_batches(args, tokens: Sequence[Sequence[int]], rows: Sequence[int], device=None, group=None,
                       log_probs: bool = False, packed: bool = False) -> list[list[int]]:
    """Micro-batches of `rows`: `--micro-batch-size` rows each, or with `--use-dynamic-batch-size` at most
    `--max-tokens-per-gpu` tokens (`--log-probs-max-tokens-per-gpu` for forward-only passes), counted padded
    or, for `packed` micro-batches, as the rows' own tokens. Packed under context parallelism a micro-batch
    holds `--context-parallel-size` times the budget: each CP rank runs 1/cp of its tokens (slime's budget too).

    Collective (under torch.distributed): the ranks of `group` (None: all) run their forwards in lockstep (FSDP
    gathers parameters in every forward, expert parallelism exchanges tokens), so every rank takes as many
    micro-batches as the rank that needs most (`same_count`)."""
    lengths = [len(tokens[r]) for r in rows]
    if not args.use_dynamic_batch_size:
        groups = split_micro_batches(rows, args.micro_batch_size)
    else:
        budget = args.log_probs_max_tokens_per_gpu if log_probs else args.max_tokens_per_gpu
        if packed and budget is not None:
            budget *= args.context_parallel_size
        groups = split_by_tokens(rows, lengths, budget, packed)
    return same_count(rows, lengths, groups, device, group)


def same_count(rows: Sequence[int], lengths: Sequence[int], groups: list[list[int]], device=None, group=None
               ) -> list[list[int]]:
    """`groups` cut (`split_into`) to the largest micro-batch count of the ranks of `group`. Ranks whose shares
    of a step differ by a row (rollouts split into several samples) may otherwise plan different counts."""
    if not dist.is_initialized():
        return groups
    count = torch.tensor([len(groups)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if int(count) > len(rows):
        raise ValueError(
            f"this rank has {len(rows)} rows of an optimizer step but another data-parallel rank runs {int(count)} "
            "micro-batches, and their forwards run in lockstep: the step's rows (rollouts split into several "
            "samples) do not divide evenly over the ranks. Use --micro-batch-size 2 or more, or "
            "--use-dynamic-batch-size with a larger --max-tokens-per-gpu"
        )
    return split_into(rows, lengths, groups, int(count))


# ---- padding -------------------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """The sequences of one forward pass: right-padded rows, or packed back to back into one row.

    Padded: `input_ids` is [B, L] and sequence i is row i. Packed (`cu_seqlens` set): `input_ids` is [1, T]
    and sequence i holds positions cu_seqlens[i] .. cu_seqlens[i+1] - 1 of that row.
    `response_starts[i]` is the position (in its row) of sequence i's first response token; the token at
    position p is predicted by the logits at p − 1. `response_mask` is [B, R] with 1 for
    t < response_lengths[i]."""

    input_ids: torch.Tensor  # [B, L] long, or [1, T] packed
    attention_mask: torch.Tensor  # [B, L] long, or [1, T] packed
    response_starts: list[int]
    response_lengths: list[int]
    response_mask: torch.Tensor  # [B, R] float
    cu_seqlens: list[int] | None = None  # packed: sequence boundaries, [0, n0, n0 + n1, ..., T] (+ a pad sequence)

    @property
    def max_response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def row_of_sequence(self) -> torch.Tensor:
        """[B] the `input_ids` row holding each sequence (all 0 when packed)."""
        count = len(self.response_lengths)
        if self.cu_seqlens is None:
            return torch.arange(count)
        return torch.zeros(count, dtype=torch.long)

    def slot_positions(self, logits_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, R] host long tensors: for each response slot, the position (in its row, less `logits_offset`) whose
        logits predict its token, and the token's position; 0 at slots past a response (masked out by users)."""
        valid = _response_mask(self.response_lengths).long()
        t = torch.arange(self.max_response_len).unsqueeze(0)
        starts = torch.as_tensor(self.response_starts, dtype=torch.long).unsqueeze(1)
        return (starts - 1 + t - logits_offset) * valid, (starts + t) * valid

    def predicting_positions(self) -> torch.Tensor:
        """[2, N] host long tensor: the `input_ids` row and the position whose logits predict each response token,
        sequence after sequence (row-major order of `response_mask`'s ones)."""
        valid = _response_mask(self.response_lengths).bool()
        rows = self.row_of_sequence.unsqueeze(1).expand_as(valid)
        return torch.stack([rows[valid], self.slot_positions()[0][valid]])

    def sequences(self) -> list[torch.Tensor]:
        """Each sequence's tokens, prompt + response (views of `input_ids`; slime's `unconcat_tokens`)."""
        ends = [s + n for s, n in zip(self.response_starts, self.response_lengths)]
        if self.cu_seqlens is None:
            return [self.input_ids[i, :end] for i, end in enumerate(ends)]
        return [self.input_ids[0, start:end] for start, end in zip(self.cu_seqlens, ends)]

    def slime_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The forward's logits (`[B, L, V]` of padded rows from position 0, or `[1, T, V]` packed) in slime's
        layout: `[1, T, V]` with the sequences back to back (a packed micro-batch's already are)."""
        if self.cu_seqlens is not None:
            return logits
        ends = [s + n for s, n in zip(self.response_starts, self.response_lengths)]
        return torch.cat([logits[i, :end] for i, end in enumerate(ends)]).unsqueeze(0)

    def first_predicting_position(self) -> int:
        """The earliest position whose logits are needed (for `logits_to_keep`)."""
        return min(s - 1 for s in self.response_starts)


def _check_lengths(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int]) -> list[int]:
    lengths = [len(t) for t in tokens]
    for i, (n, r) in enumerate(zip(lengths, response_lengths)):
        if r < 0 or r >= n:
            raise ValueError(
                f"row {i}: response_length={r} with {n} tokens; a sample needs at least one prompt token "
                "before its response (response_length < len(tokens))"
            )
    return lengths


def _response_mask(response_lengths: Sequence[int]) -> torch.Tensor:
    max_r = max(1, max(response_lengths))  # keep R >= 1 so empty responses still give well-shaped tensors
    return (torch.arange(max_r).unsqueeze(0) < torch.as_tensor(list(response_lengths)).unsqueeze(1)).float()


def make_micro_batch(
    tokens: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    pad_token_id: int = 0,
    device: torch.device | str = "cpu",
) -> MicroBatch:
    lengths = _check_lengths(tokens, response_lengths)
    max_len = max(lengths)
    input_ids = torch.full((len(tokens), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(tokens), max_len), dtype=torch.long)
    for i, t in enumerate(tokens):
        input_ids[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
        attention_mask[i, : len(t)] = 1
    return MicroBatch(
        input_ids=to_device(input_ids, device),
        attention_mask=to_device(attention_mask, device),
        response_starts=[n - r for n, r in zip(lengths, response_lengths)],
        response_lengths=list(response_lengths),
        response_mask=to_device(_response_mask(response_lengths), device),
    )


def make_packed_micro_batch(
    tokens: Sequence[Sequence[int]], response_lengths: Sequence[int], pad_token_id: int = 0,
    device: torch.device | str = "cpu", multiple: int = 1,
) -> MicroBatch:
    """The sequences back to back in one [1, T] row, with their boundaries in `cu_seqlens`. T is padded to a
    `multiple` (sequence parallelism splits it over the TP ranks) by one more sequence of pad tokens, which
    attends only to itself and has no response."""
    lengths = _check_lengths(tokens, response_lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    flat = [t for seq in tokens for t in seq]
    extra = (-len(flat)) % multiple
    if extra:
        flat += [pad_token_id] * extra
        cu.append(len(flat))
    input_ids = to_device(torch.as_tensor(flat, dtype=torch.long).unsqueeze(0), device)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        response_starts=[end - r for end, r in zip(cu[1:], response_lengths)],
        response_lengths=list(response_lengths),
        response_mask=to_device(_response_mask(response_lengths), device),
        cu_seqlens=cu,
    )


def is_on(t: torch.Tensor, device) -> bool:
    """Whether `t` is on `device` ("cuda" without an index: any GPU)."""
    device = torch.device(device)
    return t.device == device or (device.index is None and t.device.type == device.type)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; from host to GPU through pinned memory without waiting for the GPU (a plain copy from pageable
    memory waits for the stream to drain: one host sync per copy)."""
    if is_on(t, device):
        return t
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def concat_on_device(values: Sequence[Sequence[float] | torch.Tensor], device, dtype=torch.float32
                     ) -> tuple[torch.Tensor, list[int]]:
    """Per-row values (host lists, or tensors on one device) concatenated where they are and moved in one copy
    (`to_device`): (the flat `dtype` tensor on `device`, each row's length). Autograd follows tensors of one device
    through; tensors of several devices are read to the host first (detached)."""
    if values and all(torch.is_tensor(v) for v in values) and len({v.device for v in values}) == 1:
        flat = torch.cat([v.reshape(-1).to(dtype) for v in values])
        lengths = [v.numel() for v in values]
    else:
        host = [v.detach().reshape(-1).cpu().tolist() if torch.is_tensor(v) else v for v in values]
        flat = torch.tensor([x for v in host for x in v], dtype=dtype)
        lengths = [len(v) for v in host]
    return to_device(flat, device), lengths


def rows_on_device(values: Sequence[Sequence[float] | torch.Tensor], device, dtype=torch.float32
                   ) -> list[torch.Tensor]:
    """Per-row values as `dtype` tensors on `device`: views of one copy (`concat_on_device`). A copy per row syncs
    with the GPU each time (hundreds per rollout)."""
    flat, lengths = concat_on_device(values, device, dtype)
    return list(flat.split(lengths))


def pad_per_token(values: Sequence[Sequence[float] | torch.Tensor], width: int, device=None) -> torch.Tensor:
    """Per-sample per-token values -> [B, width] fp32, zero-padded (or cut) on the right, on `device` (None: where
    tensor values are, else the host); tensors are padded where they are, never read back to the host."""
    if values and all(torch.is_tensor(v) for v in values):
        if device is None:
            device = values[0].device
        on = all(is_on(v, device) for v in values)
        rows = [v.reshape(-1).float() for v in values] if on else rows_on_device(values, device)
        out = torch.nn.utils.rnn.pad_sequence([r[:width] for r in rows], batch_first=True)
        return torch.nn.functional.pad(out, (0, width - out.shape[1]))
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, v in enumerate(values):
        v = torch.as_tensor(v, dtype=torch.float32).reshape(-1)
        out[i, : v.numel()] = v[:width]
    return out if device is None else to_device(out, device)


def unpad_per_token(padded: torch.Tensor, lengths: Sequence[int]) -> list[list[float]]:
    rows = padded.detach().float().cpu()
    return [rows[i, :n].tolist() for i, n in enumerate(lengths)]
