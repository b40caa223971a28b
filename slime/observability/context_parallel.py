"""The context-parallel (CP) layout of a sample's tokens and the helpers on per-token values that slime's
`slime.backends.megatron_utils.cp_utils` offers plugins (re-exported there): a `--custom-tis-function-path` such as
slime's train-infer mismatch example gathers and re-slices log-probs with them; `--save-debug-train-data` restores
full values with `all_gather_with_cp`. Also megatron-core's parallel state as this process has it, which the
Megatron trainer's log-prob passes read their tensor-parallel group from.

The layout is slime's zigzag split: a sequence of `total_length` tokens is cut into `2 × cp_size` chunks of
`ceil(total_length / (2 × cp_size))` tokens and CP rank r holds chunks r and `2 × cp_size − 1 − r`, so every rank
gets an early and a late piece (causal attention costs about the same on each); the Megatron trainer splits every
sequence of a packed micro-batch this way (slime/backends/megatron_utils/cp_layout.py). A rank's per-token response
values (log-probs, advantages, ...) are those of the response tokens inside its two chunks, back to back; the
value of response token t is computed from the logits at position `prompt_length + t − 1`.

The CP size, rank and group are megatron-core's (`megatron.core.mpu`) once a megatron trainer has set up its
parallel groups in this process; anywhere else (the fsdp backend, a plain script) there is no context
parallelism: size 1, and every helper here is the identity or a plain per-sample sum. megatron-core is never
imported from here: a process without it, or that has not loaded it, simply has CP size 1.

Not here: slime's routing-replay helper (`prepare_routed_experts_for_routing_replay`): MoE routing replay is
not built (`--use-routing-replay` / `--use-rollout-routing-replay` are refused).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

from slime.algorithm.loss import micro_batch_sum

Range = tuple[int, int]


def parallel_state() -> Any | None:
    """megatron-core's parallel state (`megatron.core.mpu`) when this process has loaded megatron-core and set
    up its parallel groups, else None. Looked up in `sys.modules` rather than imported, so that a process which
    never ran a megatron trainer neither pays for nor depends on importing megatron-core."""
    core = sys.modules.get("megatron.core")
    mpu = getattr(core, "mpu", None)
    if mpu is None:
        return None
    # megatron-core's module says whether its groups exist; a stand-in module without that query is taken as set up
    initialized = getattr(mpu, "model_parallel_is_initialized", None)
    if initialized is not None and not initialized():
        return None
    return mpu


def tensor_parallel_group() -> Any | None:
    """megatron-core's tensor-parallel group when its parallel groups are set up and it spans more than one rank,
    else None (the vocabulary of the logits is not split)."""
    mpu = parallel_state()
    if mpu is None or mpu.get_tensor_model_parallel_world_size() == 1:
        return None
    return mpu.get_tensor_model_parallel_group()


def cp_size_and_rank() -> tuple[int, int]:
    """(context-parallel size, this rank's CP rank): (1, 0) without megatron-core's parallel groups."""
    mpu = parallel_state()
    if mpu is None:
        return 1, 0
    return mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()


def _zigzag_chunks(total_length: int, cp_size: int, cp_rank: int) -> tuple[int, tuple[Range, Range]]:
    size = -(-total_length // (2 * cp_size))
    first = (cp_rank * size, (cp_rank + 1) * size)
    second = ((2 * cp_size - 1 - cp_rank) * size, (2 * cp_size - cp_rank) * size)
    return size, (first, second)


def get_logits_and_tokens_offset_with_cp(total_length: int, response_length: int):
    """This CP rank's share of one sample, as slime returns it: `(chunk_size, (chunk_0, chunk_1), (logits_0,
    logits_1), (tokens_0, tokens_1))`, each a `(start, end)` range of positions counted from the prompt's start.
    `logits_i` are the positions of chunk i whose logits predict response tokens (from `prompt_length − 1` to
    `total_length − 2`), `tokens_i` the response tokens they predict (one position later); a chunk without any
    is `(0, 0)` in both."""
    cp_size, cp_rank = cp_size_and_rank()
    if response_length < 0 or response_length >= total_length:
        raise ValueError(f"get_logits_and_tokens_offset_with_cp: response_length {response_length} with total_length "
                         f"{total_length}; a sample needs at least one prompt token before its response")
    size, chunks = _zigzag_chunks(total_length, cp_size, cp_rank)
    prompt_length = total_length - response_length
    logits, tokens = [], []
    for start, end in chunks:
        lo, hi = max(start, prompt_length - 1), min(end, total_length - 1)
        if lo < hi:
            logits.append((lo, hi))
            tokens.append((lo + 1, hi + 1))
        else:
            logits.append((0, 0))
            tokens.append((0, 0))
    return size, chunks, tuple(logits), tuple(tokens)


def _response_ranges(total_length: int, response_length: int) -> list[Range]:
    """The ranges of response-token indices (0 .. response_length − 1) this CP rank holds, in order."""
    prompt_length = total_length - response_length
    _, _, logits, _ = get_logits_and_tokens_offset_with_cp(total_length, response_length)
    return [(lo - (prompt_length - 1), hi - (prompt_length - 1)) for lo, hi in logits if hi > lo]


def slice_log_prob_with_cp(log_prob: list[float] | torch.Tensor, total_length: int, response_length: int
                           ) -> list[float] | torch.Tensor:
    """One sample's full per-response-token values -> this CP rank's part (a list stays a list)."""
    if len(log_prob) != response_length:
        raise ValueError(f"slice_log_prob_with_cp: {len(log_prob)} values for response_length {response_length} "
                         f"(total_length {total_length}); pass one value per response token")
    if cp_size_and_rank()[0] == 1:
        return log_prob
    pieces = [log_prob[start:end] for start, end in _response_ranges(total_length, response_length)]
    if isinstance(log_prob, list):
        return [v for piece in pieces for v in piece]
    return torch.cat(pieces) if pieces else log_prob[:0]


def slice_with_cp(tokens: torch.Tensor, pad_value: int | float | Callable[[torch.Tensor, int], torch.Tensor]
                  ) -> torch.Tensor:
    """A whole sequence (first dimension) -> this CP rank's two chunks, back to back, after padding it to
    `2 × cp_size` equal chunks: with `pad_value` along the first dimension, or by `pad_value(tokens, pad)`."""
    cp_size, cp_rank = cp_size_and_rank()
    if cp_size == 1:
        return tokens
    size, chunks = _zigzag_chunks(len(tokens), cp_size, cp_rank)
    pad = 2 * cp_size * size - len(tokens)
    if callable(pad_value):
        tokens = pad_value(tokens, pad)
    elif pad:
        tokens = F.pad(tokens, (0, 0) * (tokens.dim() - 1) + (0, pad), value=pad_value)
    return torch.cat([tokens[start:end] for start, end in chunks])


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """This CP rank's part of one sample's per-response-token values -> the full `[response_length, ...]` values,
    summed over the CP group (each rank fills in its positions, zeros elsewhere); differentiable. Collective over
    the CP group when CP size > 1; the identity otherwise."""
    cp_size, _ = cp_size_and_rank()
    if cp_size == 1:
        return tensor
    ranges = _response_ranges(total_length, response_length)
    held = sum(end - start for start, end in ranges)
    if tensor.shape[0] != held:
        raise ValueError(f"all_gather_with_cp: {tensor.shape[0]} values, but this CP rank holds {held} of the "
                         f"{response_length} response tokens (total_length {total_length}); pass the CP-local part")

    def zeros(n: int) -> torch.Tensor:
        # a leaf that takes part in autograd, so that a rank holding nothing still joins the backward all-reduce
        return torch.zeros((n, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device,
                           requires_grad=tensor.is_floating_point())

    pieces, cursor, offset = [], 0, 0
    for start, end in ranges:
        pieces += [zeros(start - cursor), tensor[offset : offset + end - start]]
        cursor, offset = end, offset + end - start
    pieces.append(zeros(response_length - cursor))
    return dist_nn.all_reduce(torch.cat(pieces), group=parallel_state().get_context_parallel_group())


def get_sum_of_sample_mean(total_lengths: Sequence[int], response_lengths: Sequence[int],
                           loss_masks: Sequence[torch.Tensor],
                           sample_denoms: Sequence[torch.Tensor] | torch.Tensor | None = None,
                           calculate_per_token_loss: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's reducer of a micro-batch: a function of the flat per-token values (this CP rank's part of each
    sample, back to back) -> Σ over samples of (masked sum / the sample's denominator), or with
    `calculate_per_token_loss` the masked sum. `loss_masks` are the samples' full masks; `sample_denoms`
    defaults to each sample's own masked-token count (a per-sample mean); pass the rollout's count for every
    sample split from one rollout (slime's `rollout_mask_sums`) to weigh the rollout as one sample. The sums of
    all CP ranks add up to the value without CP. The math is slime/algorithm/loss.py `micro_batch_sum`'s."""
    masks = [torch.as_tensor(m) for m in loss_masks]
    if sample_denoms is None:
        denominators = torch.stack([m.sum().float() for m in masks]) if masks else torch.zeros(0)
    elif torch.is_tensor(sample_denoms):
        denominators = sample_denoms
    else:
        denominators = torch.stack([torch.as_tensor(d).float().reshape(()) for d in sample_denoms])
    if cp_size_and_rank()[0] > 1:
        masks = [torch.cat([m[start:end] for start, end in _response_ranges(total, n)] or [m[:0]])
                 for m, total, n in zip(masks, total_lengths, response_lengths, strict=True)]
    lengths = [m.shape[0] for m in masks]

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != sum(lengths):
            raise ValueError(f"sum_of_sample_mean: {x.shape[0]} values, but the micro-batch's samples hold "
                             f"{sum(lengths)} response tokens on this CP rank ({lengths})")
        if not lengths:
            return x.sum()
        values = torch.nn.utils.rnn.pad_sequence(list(x.split(lengths)), batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True).to(values.device)
        return micro_batch_sum(values, mask, calculate_per_token_loss, denominators.to(values.device))

    return sum_of_sample_mean
