"""What every training backend's actor does with a rollout's `TrainBatch` besides running its model:
rollout log-probs, advantages and returns (whitened across data-parallel ranks), the per-micro-batch
`LossInputs`, and the trainer/rollout log-prob agreement metric.

Per-row values are dicts {row index: [response_len] tensor} of the rows a data-parallel rank trains on;
`group` is that rank's data-parallel process group (None: the whole world).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from slime.algorithm.loss import LossInputs
from slime.backends.training.batching import MicroBatch, pad_per_token
from slime.utils import ppo_utils
from slime.utils.types import TrainBatch


def padded_rows(per_row, rows: list[int], width: int, device) -> torch.Tensor:
    """[len(rows), width] fp32 from a per-row mapping of per-token values (list or dict by row index)."""
    return pad_per_token([per_row[r] for r in rows], width, device)


def rollout_log_probs(args: Any, batch: TrainBatch, rows: list[int], device) -> dict[int, torch.Tensor] | None:
    """The engine's log-probs of `rows`, or None; errors when a flag needs them and the batch has none."""
    found = None
    if batch.rollout_log_probs is not None:
        found = {r: torch.as_tensor(batch.rollout_log_probs[r], dtype=torch.float32, device=device) for r in rows}
    for flag, attr in (("--use-tis", "use_tis"), ("--use-rollout-logprobs", "use_rollout_logprobs")):
        if getattr(args, attr) and found is None:
            raise ValueError(f"{flag}: the train batch has no rollout log-probs (the rollout function must "
                             "fill Sample.rollout_log_probs); drop the flag or return them")
    return found


def require_ref(args: Any, has_ref: bool) -> None:
    if (args.use_kl_loss or args.kl_coef) and not has_ref:
        raise ValueError("--use-kl-loss / --kl-coef need the reference model, but the actor was initialised "
                         "without one (with_ref=False); the actor group must pass with_ref=True")


def advantages_and_returns(args: Any, batch: TrainBatch, rows: list[int], old_lp, ref_lp, values, device,
                           group=None):
    """Advantages (whitened over the group with --normalize-advantages) and returns of `rows`."""
    masks = {r: torch.as_tensor(batch.loss_masks[r], dtype=torch.float32) for r in rows}
    kl = None
    if ref_lp is not None:
        kl = [ppo_utils.compute_approx_kl(old_lp[r].cpu(), ref_lp[r].cpu(), args.kl_loss_type) for r in rows]
    inputs = ppo_utils.AdvantageInputs(
        rewards=[batch.rewards[r] for r in rows], raw_rewards=[batch.raw_rewards[r] for r in rows],
        response_lengths=[batch.response_lengths[r] for r in rows],
        loss_masks=[masks[r] for r in rows], group_indices=[batch.group_indices[r] for r in rows],
        kl=kl, values=None if values is None else [torch.as_tensor(values[r], dtype=torch.float32) for r in rows],
    )
    adv_list, ret_list = ppo_utils.compute_advantages_and_returns(args, inputs)
    if args.normalize_advantages:
        adv_list = whiten(adv_list, inputs.loss_masks, device, group)
    advantages = {r: a.to(device) for r, a in zip(rows, adv_list)}
    returns = None if ret_list is None else dict(zip(rows, ret_list))
    return advantages, returns


def whiten(advantages: list[torch.Tensor], masks: list[torch.Tensor], device, group=None) -> list[torch.Tensor]:
    """--normalize-advantages: moments all-reduced over the group, so the whole rollout batch is whitened."""
    if not advantages:
        moments = torch.zeros(3, dtype=torch.float64)
    else:
        moments = ppo_utils.masked_moments(torch.cat(advantages), torch.cat(masks))
    moments = moments.to(device)
    dist.all_reduce(moments, group=group)
    return [ppo_utils.whiten_with_moments(a, m, moments.cpu()) for a, m in zip(advantages, masks)]


def logprob_abs_diff(old_lp, rollout_lp, batch: TrainBatch, device, group=None) -> float:
    """Mean |recomputed − rollout| log-prob over loss-masked response tokens of the whole batch."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for r, lp in old_lp.items():
        mask = torch.as_tensor(batch.loss_masks[r], dtype=torch.float32, device=device)
        total[0] += ((lp - rollout_lp[r]).abs() * mask).sum().double()
        total[1] += mask.sum().double()
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1].clamp_min(1.0))


def loss_denominator(args: Any, batch: TrainBatch, global_rows) -> float:
    """Per-sample mean: the step's rows; --calculate-per-token-loss: its loss-masked tokens."""
    if args.calculate_per_token_loss:
        return max(1, sum(sum(batch.loss_masks[r]) for r in global_rows))
    return len(global_rows)


def loss_inputs(args: Any, batch: TrainBatch, rows: list[int], mb: MicroBatch, log_probs, entropy, advantages,
                old_lp, ref_lp, rollout_lp, denominator: float) -> LossInputs:
    """The `[B, R]` loss inputs of one micro-batch, its loss shares aggregated over `denominator`."""
    device = log_probs.device
    padded = functools.partial(padded_rows, rows=rows, width=mb.max_response_len, device=device)
    mask = mb.response_mask.to(device) * padded(batch.loss_masks)
    return LossInputs(
        log_probs=log_probs, old_log_probs=padded(old_lp), advantages=padded(advantages), mask=mask,
        entropy=entropy, ref_log_probs=None if ref_lp is None else padded(ref_lp),
        rollout_log_probs=None if rollout_lp is None else padded(rollout_lp),
        aggregate=functools.partial(ppo_utils.aggregate_loss, mask=mask,
                                    per_token=args.calculate_per_token_loss,
                                    global_denominator=denominator),
    )
