"""`RolloutRecord`: what a training rank holds of one rollout while it trains on it, and the per-micro-batch
loss built from it. Backend-agnostic: both backends fill it the same way (slime/backends/training/policy.py).

Per-row values are dicts {row index: [response_len] tensor} of the rows this data-parallel rank trains on;
`group` is the rank's data-parallel process group (None: the whole world). `rollout_inputs` is the one view of
them as the algorithm's `AdvantageInputs` (slime's rollout_data dict, `AdvantageInputs.to_rollout_data`): the
advantage step and --rollout-data-postprocess-path both read it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from slime.algorithm.estimators import AdvantageInputs, compute_advantages_and_returns
from slime.algorithm.loss import LossInputs, compute_actor_loss
from slime.algorithm.objectives import compute_approx_kl
from slime.algorithm.opd import missing_teacher_message, opd_advantages
from slime.algorithm.returns import masked_moments, whiten_with_moments
from slime.algorithm.slime_formats import LossHookInputs, loss_hooks_set
from slime.backends.training.batching import MicroBatch, pad_per_token
from slime.utils.types import TrainBatch

PerRow = dict[int, torch.Tensor]


@dataclass
class RolloutRecord:
    batch: TrainBatch
    steps: list[list[list[int]]]  # per optimizer step, this rank's micro-batches (row indices)
    rollout_id: int = 0
    loss_masks: PerRow | None = None  # the batch's, as --rollout-data-postprocess-path leaves them
    denominators: list[float] | None = None  # per optimizer step, its loss_denominator
    mask_sums: list[float] | None = None  # per row of the batch, its rollout's loss-masked tokens (rollout_mask_sums)
    rollout_log_probs: PerRow | None = None  # the engines' (when the rollout returned them)
    old_log_probs: PerRow | None = None  # the behaviour policy's; filled by the training forward when reused
    ref_log_probs: PerRow | None = None  # the frozen reference model's (KL terms)
    advantages: PerRow | None = None  # None off the last pipeline stage
    returns: PerRow | None = None  # for a critic
    teacher_log_probs: PerRow | None = None  # on-policy distillation's teacher (--use-opd)
    opd_reverse_kl: PerRow | None = None  # student − teacher log-probs, once the advantages hold them
    reuse_training_forward: bool = False  # the old log-probs are the training forward's own (detached)
    # --use-rollout-entropy: each log-prob pass's per-token entropies, by slime's rollout_data key ("entropy" the
    # old policy's, "ref_entropy", "teacher_entropy")
    entropies: dict[str, PerRow] = field(default_factory=dict)

    @property
    def rows(self) -> list[int]:
        return [r for step in self.steps for mb in step for r in mb]

    def micro_batch_loss(self, args: Any, rows: list[int], mb: MicroBatch, log_probs: torch.Tensor,
                         entropy: torch.Tensor, denominator: float, logits: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of its step's loss (and metric shares) from its forward's `[B, R]`
        log-probs and entropies (`logits`: the forward's, in slime's `[1, T, V]` layout, for a custom loss).
        With `reuse_training_forward` the forward's detached log-probs are first recorded as the old ones (one
        optimizer step per rollout: the trained policy generated them)."""
        if self.reuse_training_forward:
            if self.old_log_probs is None:
                self.old_log_probs = {}
            for i, r in enumerate(rows):
                self.old_log_probs[r] = log_probs[i, : self.batch.response_lengths[r]].detach()
        return compute_actor_loss(args, self.loss_inputs(args, rows, mb, log_probs, entropy, denominator, logits))

    def loss_inputs(self, args: Any, rows: list[int], mb: MicroBatch, log_probs: torch.Tensor,
                    entropy: torch.Tensor, denominator: float, logits: torch.Tensor | None = None) -> LossInputs:
        """The loss's inputs of one micro-batch: padded `[B, R]` per-token values, the step's denominator and the
        rollouts' mask sums; what only slime's loss hooks read (the rows' lengths and tokens, the logits, the
        teacher's log-probs) only when one is set (`loss_hooks_set`)."""
        device = log_probs.device
        padded = functools.partial(padded_rows, rows=rows, width=mb.max_response_len, device=device)
        mask = mb.response_mask.to(device) * padded(self.loss_masks)
        sample_denominators = None
        if self.mask_sums is not None:
            sample_denominators = torch.tensor([self.mask_sums[r] for r in rows], dtype=torch.float32, device=device)
        hook_inputs = None
        if loss_hooks_set(args):
            hook_inputs = LossHookInputs(
                response_lengths=[self.batch.response_lengths[r] for r in rows],
                total_lengths=[len(self.batch.tokens[r]) for r in rows], tokens=mb.sequences(), logits=logits,
                teacher_log_probs=None if self.teacher_log_probs is None else padded(self.teacher_log_probs))
        return LossInputs(
            log_probs=log_probs, old_log_probs=padded(self.old_log_probs),
            advantages=None if self.advantages is None else padded(self.advantages),
            mask=mask, entropy=entropy,
            ref_log_probs=None if self.ref_log_probs is None else padded(self.ref_log_probs),
            rollout_log_probs=None if self.rollout_log_probs is None else padded(self.rollout_log_probs),
            global_denominator=denominator, sample_denominators=sample_denominators,
            opd_reverse_kl=None if self.opd_reverse_kl is None else padded(self.opd_reverse_kl),
            hook_inputs=hook_inputs,
        )


def padded_rows(per_row, rows: list[int], width: int, device) -> torch.Tensor:
    """[len(rows), width] fp32 from a per-row mapping of per-token values (list or dict by row index)."""
    return pad_per_token([per_row[r] for r in rows], width, device)


def rollout_log_probs(args: Any, batch: TrainBatch, rows: list[int], device) -> PerRow | None:
    """The engine's log-probs of `rows`, or None; errors when a flag needs them and the batch has none."""
    found = None
    if batch.rollout_log_probs is not None:
        found = {r: torch.as_tensor(batch.rollout_log_probs[r], dtype=torch.float32, device=device) for r in rows}
    for flag, attr in (("--use-tis", "use_tis"), ("--use-rollout-logprobs", "use_rollout_logprobs")):
        if getattr(args, attr) and found is None:
            raise ValueError(f"{flag}: the train batch has no rollout log-probs (the rollout function must "
                             "fill Sample.rollout_log_probs); drop the flag or return them")
    return found


def batch_teacher_log_probs(args: Any, batch: TrainBatch, rows: list[int], device) -> PerRow:
    """--use-opd --opd-type sglang: the teacher's log-probs the rollout put in the batch; an error naming the
    plugins that fill them when there are none."""
    if batch.teacher_log_probs is None:
        raise ValueError(missing_teacher_message(args.opd_type))
    return {r: torch.as_tensor(batch.teacher_log_probs[r], dtype=torch.float32, device=device) for r in rows}


def require_ref(args: Any, has_ref: bool) -> None:
    if (args.use_kl_loss or args.kl_coef) and not has_ref:
        raise ValueError("--use-kl-loss / --kl-coef need the reference model, but the actor was initialised "
                         "without one (with_ref=False); the actor group must pass with_ref=True")


def rollout_inputs(record: RolloutRecord, device=None) -> AdvantageInputs:
    """This rank's rows as `AdvantageInputs` (copies, on `device`; None: where each tensor is): the batch's
    per-row fields, the record's loss masks and log-probs, and its advantages / returns once computed. A per-row
    value is given only when the record holds it for every row (e.g. no old log-probs off the last stage)."""
    batch, rows = record.batch, record.rows

    def per_row(values: PerRow | None) -> list[torch.Tensor] | None:
        if values is None or not all(r in values for r in rows):
            return None
        return [values[r].detach().to(device if device is not None else values[r].device, torch.float32, copy=True)
                for r in rows]

    return AdvantageInputs(
        rewards=[batch.rewards[r] for r in rows], raw_rewards=[batch.raw_rewards[r] for r in rows],
        response_lengths=[batch.response_lengths[r] for r in rows], loss_masks=per_row(record.loss_masks),
        group_indices=[batch.group_indices[r] for r in rows], log_probs=per_row(record.old_log_probs),
        ref_log_probs=per_row(record.ref_log_probs), rollout_log_probs=per_row(record.rollout_log_probs),
        total_lengths=[len(batch.tokens[r]) for r in rows], partition=list(rows),
        tokens=[torch.as_tensor(batch.tokens[r], dtype=torch.long) for r in rows],
        truncated=[int(batch.truncated[r]) for r in rows], batch_raw_rewards=list(batch.raw_rewards),
        advantages=per_row(record.advantages), returns=per_row(record.returns),
        teacher_log_probs=per_row(record.teacher_log_probs),
        entropies={key: known for key, values in record.entropies.items()
                   if (known := per_row(values)) is not None},
    )


def advantages_and_returns(args: Any, record: RolloutRecord, values, device, group=None) -> None:
    """Fill the record's advantages (whitened over `group` with --normalize-advantages) and returns, computed on
    the CPU from `rollout_inputs` with the KL of the old policy to the reference (when one runs) and the critic's
    `values` (per row of the batch); with --use-opd the teacher's reverse KL enters the advantages before the
    whitening (slime/algorithm/opd.py). With --disable-compute-advantages-and-returns both stay None, as in slime
    (a custom loss then finds `advantages` None)."""
    if not args.compute_advantages_and_returns:  # slime's --disable-compute-advantages-and-returns: none at all
        record.advantages = record.returns = None
        return
    rows = record.rows
    inputs = rollout_inputs(record, "cpu")
    if inputs.ref_log_probs is not None:
        inputs.kl = [compute_approx_kl(old, ref, args.kl_loss_type)
                     for old, ref in zip(inputs.log_probs, inputs.ref_log_probs)]
    if values is not None:
        inputs.values = [torch.as_tensor(values[r], dtype=torch.float32) for r in rows]
    adv_list, ret_list = compute_advantages_and_returns(args, inputs)
    if args.use_opd:
        if inputs.teacher_log_probs is None:
            raise ValueError(missing_teacher_message(args.opd_type))
        adv_list, reverse_kls = opd_advantages(adv_list, inputs.log_probs, inputs.teacher_log_probs, args.opd_kl_coef)
        record.opd_reverse_kl = {r: kl.to(device) for r, kl in zip(rows, reverse_kls)}
    if args.normalize_advantages:
        adv_list = whiten(adv_list, inputs.loss_masks, device, group)
    record.advantages = {r: a.to(device) for r, a in zip(rows, adv_list)}
    record.returns = None if ret_list is None else dict(zip(rows, ret_list))


def whiten(advantages: list[torch.Tensor], masks: list[torch.Tensor], device, group=None) -> list[torch.Tensor]:
    """--normalize-advantages: moments all-reduced over the group, so the whole rollout batch is whitened."""
    if not advantages:
        moments = torch.zeros(3, dtype=torch.float64)
    else:
        moments = masked_moments(torch.cat(advantages), torch.cat(masks))
    moments = moments.to(device)
    dist.all_reduce(moments, group=group)
    return [whiten_with_moments(a, m, moments.cpu()) for a, m in zip(advantages, masks)]


def logprob_abs_diff(old_lp: PerRow, rollout_lp: PerRow, masks: PerRow, device, group=None) -> float:
    """Mean |recomputed − rollout| log-prob over loss-masked response tokens of the whole batch."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for r, lp in old_lp.items():
        mask = masks[r].to(device)
        total[0] += ((lp - rollout_lp[r]).abs() * mask).sum().double()
        total[1] += mask.sum().double()
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1].clamp_min(1.0))


def token_mean(values: PerRow, device, group=None) -> float:
    """Mean of per-token values over every response token of the batch (all data-parallel ranks' rows; not
    loss-masked, as slime's rollout log of such a tensor)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for value in values.values():
        total[0] += value.to(device).sum().double()
        total[1] += value.numel()
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1].clamp_min(1.0))


def loss_denominator(args: Any, batch: TrainBatch, global_rows) -> float:
    """The step's (`global_rows`, every rank's) loss denominator: per-sample mean, its rollouts (slime's
    step_global_batch_size: --global-batch-size); --calculate-per-token-loss: its loss-masked tokens."""
    if args.calculate_per_token_loss:
        return max(1, sum(sum(batch.loss_masks[r]) for r in global_rows))
    rollout_of = batch.rollout_of_rows()
    return len({rollout_of[r] for r in global_rows})
