"""Forward passes of the Megatron backend: micro-batches through megatron-core's pipeline schedules, and
log-probs / entropy from vocab-parallel logits.

Micro-batches (slime/backends/training/batching.py) are packed (`--qkv-format thd`, the default): the samples back
to back in one `[1, T]` row described by megatron-core's `PackedSeqParams` (cu_seqlens), each attending only
to itself with rotary positions restarting at its start — TransformerEngine's attention when installed, else
torch's varlen flash attention (`sdpa_attention.py`). Or right-padded `[B, L]` rows (`--qkv-format bshd`) run
with the default causal mask: with right padding a real token never attends to a pad, so no padding mask
is needed. Either way each sample's log-probs equal those of the sample alone. With `--context-parallel-size` > 1
(packed only) each CP rank runs its zigzag share of the row and the per-token log-probs are gathered back into
whole sequences before the loss (cp_layout.py).

Log-probs and entropy of the response tokens come from the vocab-parallel logits in place, chunk by chunk
(slime/algorithm/log_probs.py: no fp32 copy of the logits kept for backward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slime.algorithm.log_probs_triton import vocab_kernel
from slime.backends.megatron_utils import sdpa_attention
from slime.backends.megatron_utils.cp_layout import (cp_group_size_rank, gather_cp, pad_row, padded_boundaries,
                                                     zigzag_layout)
from slime.backends.training.batching import MicroBatch, to_device
from slime.observability.context_parallel import tensor_parallel_group


def response_log_probs(
    logits: torch.Tensor, mb: MicroBatch, temperature: float, vocab_size: int, with_entropy: bool = False,
    kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[B, L, V/tp]` logits of a padded micro-batch (or `[1, T, V/tp]` of a packed one) -> `[B, R]` fp32
    response log-probs (0 past each response), and entropies, of softmax(logits / temperature). `kernel`:
    --log-probs-kernel (slime/algorithm/log_probs_triton.py's `vocab_kernel`)."""
    if temperature <= 0:
        raise ValueError(f"--rollout-temperature {temperature}: must be > 0")
    if mb.cu_seqlens is not None and cp_group_size_rank()[0] > 1:
        return _response_log_probs_cp(logits, mb, temperature, vocab_size, with_entropy, kernel)
    device = logits.device
    valid = mb.response_mask.to(device).bool()
    # built on the host and copied without a sync (a boolean index of a GPU tensor waits for the GPU)
    rows, predicting = to_device(mb.predicting_positions(), device)
    targets = mb.input_ids.to(device)[rows, predicting + 1]
    # the rows of the [B·L, V/tp] view that predict response tokens, read in place (no copy of the block)
    flat = rows * logits.shape[1] + predicting
    lp_flat, ent_flat = vocab_kernel(kernel)(logits.reshape(-1, logits.shape[-1]), targets, temperature=temperature,
                                              with_entropy=with_entropy, rows=flat, vocab_size=vocab_size,
                                              group=tensor_parallel_group())
    log_probs = torch.zeros(valid.shape, dtype=torch.float32, device=device)
    log_probs = log_probs.masked_scatter(valid, lp_flat)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_scatter(valid, ent_flat)
    return log_probs, entropy


def _response_log_probs_cp(logits: torch.Tensor, mb: MicroBatch, temperature: float, vocab_size: int,
                           with_entropy: bool, kernel: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` of a packed micro-batch under context parallelism: `logits` are this CP rank's
    `[1, T_pad / cp, V/tp]` (cp_layout.py); the log-prob (and entropy) of every position's next token is computed
    for the rank's tokens, gathered over the CP group and read at the response positions of the whole row."""
    cp_size, cp_rank, group = cp_group_size_rank()
    device = logits.device
    layout = zigzag_layout(tuple(padded_boundaries(mb.cu_seqlens, cp_size)), cp_size, cp_rank, str(device))
    ids, original = pad_row(mb.input_ids[0].to(device), mb.cu_seqlens, layout.padded_cu)
    # the token after each of this rank's positions (the last position of the row predicts nothing real)
    targets = ids[(layout.local_index + 1).clamp(max=ids.shape[0] - 1)]
    lp, ent = vocab_kernel(kernel)(logits.reshape(-1, logits.shape[-1]), targets, temperature=temperature,
                                    with_entropy=with_entropy, vocab_size=vocab_size, group=tensor_parallel_group())
    local = torch.stack([lp, ent], dim=1) if with_entropy else lp.unsqueeze(1)
    # every rank computes the same loss from these, so each keeps its own rows of the gradient (no sum)
    row = gather_cp(local, group, sum_grad=False)[layout.gather_order][original]  # [T, 1 or 2]
    valid = mb.response_mask.to(device).bool()
    predicting = to_device(mb.predicting_positions()[1], device)  # packed: every sequence is in row 0
    log_probs = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_scatter(valid, row[predicting, 0])
    entropy = None
    if with_entropy:
        entropy = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_scatter(valid,
                                                                                              row[predicting, 1])
    return log_probs, entropy


def _pad_to_multiple(mb: MicroBatch, multiple: int) -> torch.Tensor:
    """input_ids right-padded so that L divides by `multiple` (sequence parallelism splits L over TP)."""
    ids = mb.input_ids
    extra = (-ids.shape[1]) % multiple
    if extra:
        ids = torch.nn.functional.pad(ids, (0, extra))
    return ids


def packed_positions(cu_seqlens: list[int], device) -> torch.Tensor:
    """[1, T] position ids restarting at 0 for each packed sequence."""
    positions = torch.cat([torch.arange(end - start) for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    return to_device(positions, device).unsqueeze(0)  # built on the host: one copy, not a kernel per sequence


def cp_local_inputs(cu_seqlens: list[int], input_ids: torch.Tensor, cp_size: int, cp_rank: int):
    """This CP rank's `[1, T_pad / cp]` tokens of a packed row, their positions within their sequences, and the
    `PackedSeqParams` of the padded row (cp_layout.py), as the model's forward takes them."""
    padded_cu = padded_boundaries(cu_seqlens, cp_size)
    layout = zigzag_layout(tuple(padded_cu), cp_size, cp_rank, str(input_ids.device))
    ids, _ = pad_row(input_ids[0], cu_seqlens, padded_cu)
    return (ids[layout.local_index].unsqueeze(0), layout.local_positions.unsqueeze(0),
            packed_seq_params(padded_cu, input_ids.device))


def packed_seq_params(cu_seqlens: list[int], device):
    """megatron-core's THD description of a packed micro-batch: each sequence attends only to itself, and
    rotary positions restart at each sequence's start."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = to_device(torch.tensor(cu_seqlens, dtype=torch.int32), device)
    longest = max(end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    # slime's attention reads it (sdpa_attention.py): the padded layout, built here on the host once per micro-batch
    params.padded_rows = sdpa_attention.padded_rows(cu_seqlens) if sdpa_attention.pads_packed() else None
    return params


LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]


def run_pipeline(
    model: list[torch.nn.Module], micro_batches: list[MicroBatch], loss_fn: LossFn, forward_only: bool,
    model_inputs: list[dict] | None = None,
) -> list[dict]:
    """All micro-batches through megatron-core's schedule for this PP layout (1F1B, interleaved, or none).

    `loss_fn(mb, logits)` runs on the last pipeline stage and returns (loss to backpropagate, outputs);
    the loss is scaled by the caller (the schedule divides it by the number of micro-batches). Returns
    the outputs of every micro-batch, in order, on the last stage; [] on other stages. `model_inputs` (one dict per
    micro-batch) go to the model's forward as keyword arguments, a `position_ids` among them in place of the
    positions the layout gives (a vision-language model's 3-D positions and images: vision_language.py)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    multiple = ps.get_tensor_model_parallel_world_size() if model[0].config.sequence_parallel else 1
    cp_size, cp_rank, _ = cp_group_size_rank()

    def forward_step(data_iterator, chunk):
        mb, extra = next(data_iterator)
        extra = dict(extra)
        positions = extra.pop("position_ids", None)
        if mb.cu_seqlens is not None and cp_size > 1:
            ids, positions, params = cp_local_inputs(mb.cu_seqlens, mb.input_ids, cp_size, cp_rank)
            output = chunk(ids, positions, None, packed_seq_params=params, **extra)
        elif mb.cu_seqlens is not None:
            ids = mb.input_ids
            if positions is None:
                positions = packed_positions(mb.cu_seqlens, ids.device)
            output = chunk(ids, positions, None, packed_seq_params=packed_seq_params(mb.cu_seqlens, ids.device),
                           **extra)
        else:
            ids = _pad_to_multiple(mb, multiple)
            if positions is None:
                positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
            output = chunk(ids, positions, None, **extra)
        return output, lambda out: loss_fn(mb, out)

    inputs = model_inputs if model_inputs is not None else [{} for _ in micro_batches]
    iterators = [iter(list(zip(micro_batches, inputs))) for _ in model]
    max_len = max(_pad_to_multiple(mb, multiple).shape[1] for mb in micro_batches)
    if cp_size > 1 and micro_batches[0].cu_seqlens is not None:  # the tokens a CP rank holds
        max_len = max(padded_boundaries(mb.cu_seqlens, cp_size)[-1] // cp_size for mb in micro_batches)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(micro_batches),
        seq_length=max_len,
        micro_batch_size=max(mb.input_ids.shape[0] for mb in micro_batches),
        forward_only=forward_only,
    )
