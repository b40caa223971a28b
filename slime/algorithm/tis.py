"""slime's importance-sampling functions for `--custom-tis-function-path`, in slime's contract:

    fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kwargs)
        -> (pg_loss, loss_masks, metrics)

`pg_loss` is the micro-batch's per-token policy loss, flat (its samples' response tokens back to back); the
log-probs and loss masks are lists of one [T_i] tensor per sample (`train_log_probs` the recomputed old
policy's). It returns the corrected flat pg_loss, the (possibly rejection-modified) per-sample masks, and
{name: flat per-token tensor} metrics, logged as `train/<name>` means. slime ships these two at
`slime.backends.megatron_utils.loss`; without the flag, `--use-tis` applies the same truncation as
`vanilla_tis_function` (slime/algorithm/loss.py).
"""

from __future__ import annotations

from typing import Any

import torch

from slime.algorithm.objectives import icepop_weights, tis_weights


def vanilla_tis_function(args: Any, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
                         rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor], **kwargs: Any,
                         ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """TIS: pg_loss × clamp(exp(logp_train − logp_rollout), --tis-clip-low, --tis-clip); masks unchanged."""
    weights, metrics = tis_weights(torch.cat(train_log_probs), torch.cat(rollout_log_probs),
                                             args.tis_clip, args.tis_clip_low)
    return pg_loss * weights, loss_masks, metrics


def icepop_function(args: Any, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
                    rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor], **kwargs: Any,
                    ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """IcePop: pg_loss × the ratio where it lies in [--tis-clip-low, --tis-clip], × 0 elsewhere."""
    weights, metrics = icepop_weights(torch.cat(train_log_probs), torch.cat(rollout_log_probs),
                                                args.tis_clip, args.tis_clip_low)
    return pg_loss * weights, loss_masks, metrics
