"""Batch plumbing of the fsdp backend: which rows a rank trains on, micro-batching with right padding,
and per-response-token log-prob / entropy extraction from a causal LM's logits.

Simplifications: fixed-size micro-batches (`--micro-batch-size`) padded to their longest sequence with an
attention mask; no sequence packing, no `--use-dynamic-batch-size` / `--max-tokens-per-gpu`, no
`--balance-data`. Right padding keeps every real token's position id and causal context unchanged, so a
padded row computes the same log-probs as the row alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch


# ---- which rows -------------------------------------------------------------------------------------------
def rows_per_step(num_rows: int, global_batch_size: int, world_size: int, rank: int) -> list[list[int]]:
    """Row indices this rank trains on, one list per optimizer step.

    Step s covers rows [s·gbs, (s+1)·gbs); each rank takes a contiguous 1/world_size share of them."""
    if global_batch_size <= 0 or num_rows % global_batch_size != 0:
        raise ValueError(
            f"the train batch has {num_rows} samples, which is not a multiple of --global-batch-size "
            f"{global_batch_size}; make --rollout-batch-size × --n-samples-per-prompt a multiple of it"
        )
    if global_batch_size % world_size != 0:
        raise ValueError(
            f"--global-batch-size {global_batch_size} is not divisible by the {world_size} training ranks; "
            f"use a multiple of {world_size}"
        )
    share = global_batch_size // world_size
    return [
        list(range(s * global_batch_size + rank * share, s * global_batch_size + (rank + 1) * share))
        for s in range(num_rows // global_batch_size)
    ]


def split_micro_batches(rows: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size {micro_batch_size}: must be >= 1")
    return [list(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]


# ---- padding -------------------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """Right-padded sequences of one forward pass.

    `response_starts[i]` is the position of row i's first response token; the token at position p is
    predicted by the logits at p − 1. `response_mask` is [B, R] with 1 for t < response_lengths[i]."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    response_starts: list[int]
    response_lengths: list[int]
    response_mask: torch.Tensor  # [B, R] float

    @property
    def max_response_len(self) -> int:
        return self.response_mask.shape[1]

    def first_predicting_position(self) -> int:
        """The earliest position whose logits are needed (for `logits_to_keep`)."""
        return min(s - 1 for s in self.response_starts)


def make_micro_batch(
    tokens: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    pad_token_id: int = 0,
    device: torch.device | str = "cpu",
) -> MicroBatch:
    lengths = [len(t) for t in tokens]
    for i, (n, r) in enumerate(zip(lengths, response_lengths)):
        if r < 0 or r >= n:
            raise ValueError(
                f"row {i}: response_length={r} with {n} tokens; a sample needs at least one prompt token "
                "before its response (response_length < len(tokens))"
            )
    max_len = max(lengths)
    input_ids = torch.full((len(tokens), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(tokens), max_len), dtype=torch.long)
    for i, t in enumerate(tokens):
        input_ids[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
        attention_mask[i, : len(t)] = 1
    max_r = max(1, max(response_lengths))  # keep R >= 1 so empty responses still give well-shaped tensors
    response_mask = (torch.arange(max_r).unsqueeze(0) < torch.as_tensor(list(response_lengths)).unsqueeze(1)).float()
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        response_starts=[n - r for n, r in zip(lengths, response_lengths)],
        response_lengths=list(response_lengths),
        response_mask=response_mask.to(device),
    )


def pad_per_token(values: Sequence[Sequence[float] | torch.Tensor], width: int, device=None) -> torch.Tensor:
    """Per-sample per-token lists -> [B, width] fp32, zero-padded on the right."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, v in enumerate(values):
        v = torch.as_tensor(v, dtype=torch.float32).reshape(-1)
        out[i, : v.numel()] = v[:width]
    return out if device is None else out.to(device)


def unpad_per_token(padded: torch.Tensor, lengths: Sequence[int]) -> list[list[float]]:
    rows = padded.detach().float().cpu()
    return [rows[i, :n].tolist() for i, n in enumerate(lengths)]


# ---- log-prob extraction --------------------------------------------------------------------------------
def extract_response_log_probs(
    logits: torch.Tensor,
    mb: MicroBatch,
    temperature: float,
    logits_offset: int = 0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at each response token, as [B, R] fp32 (0 past each response).

    `logits` [B, K, V] hold positions [logits_offset, logits_offset + K) of the padded sequence (a model
    run with `logits_to_keep` returns only the last K). With `with_entropy`, also the per-token entropy
    of the same temperature-scaled distribution."""
    if temperature <= 0:
        raise ValueError(f"--rollout-temperature {temperature}: must be > 0")
    _, kept, vocab = logits.shape
    device = logits.device
    t = torch.arange(mb.max_response_len, device=device).unsqueeze(0)
    starts = torch.as_tensor(mb.response_starts, device=device).unsqueeze(1)
    valid = mb.response_mask.to(device).bool()
    # Padded response slots point at an arbitrary valid position; they are masked out below.
    predicting = torch.where(valid, starts - 1 + t - logits_offset, torch.zeros_like(t))
    if int(predicting.min()) < 0 or int(predicting.max()) >= kept:
        raise ValueError(
            f"logits cover positions [{logits_offset}, {logits_offset + kept}) but a response needs "
            f"[{logits_offset + int(predicting.min())}, {logits_offset + int(predicting.max()) + 1})"
        )
    targets = torch.where(valid, mb.input_ids.gather(1, torch.where(valid, starts + t, torch.zeros_like(t))), 0)
    selected = logits.gather(1, predicting.unsqueeze(-1).expand(-1, -1, vocab)).float() / temperature
    log_p = torch.log_softmax(selected, dim=-1)
    token_log_probs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * valid
    entropy = None
    if with_entropy:
        entropy = -(log_p.exp() * log_p).sum(-1) * valid
    return token_log_probs, entropy


def supports_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def forward_response_log_probs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the model on a micro-batch and return [B, R] response log-probs (and entropies).

    Only the positions from the earliest response-predicting one onwards go through the LM head, which
    saves the [B, L, V] logits of long prompts."""
    kwargs = {}
    offset = 0
    if supports_logits_to_keep(model):
        offset = mb.first_predicting_position()
        kwargs["logits_to_keep"] = mb.input_ids.shape[1] - offset
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, **kwargs)
    return extract_response_log_probs(out.logits, mb, temperature, offset, with_entropy)


# ---- critic values --------------------------------------------------------------------------------------
def extract_response_values(position_values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """[B, L] per-position values -> [B, R]: V_t of response token t is read at the position that predicts
    it (the last token of the prefix before it), like the log-probs; 0 past each response."""
    device = position_values.device
    t = torch.arange(mb.max_response_len, device=device).unsqueeze(0)
    starts = torch.as_tensor(mb.response_starts, device=device).unsqueeze(1)
    valid = mb.response_mask.to(device).bool()
    predicting = torch.where(valid, starts - 1 + t, torch.zeros_like(t))
    return position_values.gather(1, predicting).float() * valid


def forward_response_values(value_model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Run a value model (`forward(input_ids, attention_mask) -> [B, L]`) and return [B, R] response values."""
    return extract_response_values(value_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask), mb)
