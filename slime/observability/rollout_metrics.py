"""Rollout metrics read off the samples themselves (slime's `slime.observability.rollout_metrics`); the
metrics of rewards, lengths and truncation are slime/utils/metrics.py's, on plain lists.

`top_p_kept_vocab_metrics(samples)`: with top-p sampling an engine can report, per response token, the nucleus
it sampled from (`Sample.rollout_top_p_token_ids` / `rollout_top_p_token_offsets`: token i kept
`offsets[i + 1] − offsets[i]` candidates). `top_p_kept_vocab_per_token` is their mean over the loss-masked
response tokens of the samples that carry them (all response tokens of a sample without a loss mask),
leaving out samples marked `remove_sample`; no such token: no metric.
"""

from __future__ import annotations

from typing import Any

import torch

from slime.utils.types import Sample


def top_p_kept_vocab_metrics(samples: list[Sample]) -> dict[str, float]:
    kept = tokens = 0
    for sample in samples:
        offsets = sample.rollout_top_p_token_offsets
        if offsets is None or sample.response_length == 0:
            continue
        offsets = torch.as_tensor(offsets, dtype=torch.int64)
        if offsets.numel() == 0:
            continue
        if offsets.numel() != sample.response_length + 1:
            raise ValueError(f"sample {sample.index}: {offsets.numel()} rollout_top_p_token_offsets for "
                             f"response_length {sample.response_length}; there must be one more than response tokens")
        if sample.remove_sample:
            continue
        widths = offsets[1:] - offsets[:-1]
        if sample.loss_mask is None:
            kept += int(widths.sum())
            tokens += sample.response_length
            continue
        mask = torch.as_tensor(sample.loss_mask, dtype=torch.bool)
        if mask.numel() != sample.response_length:
            raise ValueError(f"sample {sample.index}: loss_mask has {mask.numel()} entries for response_length "
                             f"{sample.response_length}")
        kept += int(widths[mask].sum())
        tokens += int(mask.sum())
    return {"top_p_kept_vocab_per_token": kept / tokens} if tokens else {}


def _compute_top_p_kept_vocab_metrics(args: Any, all_samples: list[Sample]) -> dict[str, float]:
    """slime's name and signature for `top_p_kept_vocab_metrics` (`args` is not read)."""
    return top_p_kept_vocab_metrics(all_samples)
