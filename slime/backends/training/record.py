"""`RolloutRecord`: what a training rank holds of one rollout while it trains on it, and the per-micro-batch
loss built from it. Backend-agnostic: both backends fill it the same way (slime/backends/training/policy.py).

Per-row values are dicts {row index: [response_len] tensor} of the rows this data-parallel rank trains on: the
one place a rank declares them. `group` is the rank's data-parallel process group (None: the whole world). The
algorithm reads views of them: the advantage step `AdvantageInputs` (the estimators' fields, rows in training
order), the loss `LossInputs` (one micro-batch, padded `[B, R]`). slime's formats are built from the record only
for the hooks that read them (`slime_rollout_data`, `LossInputs.hook_inputs`: slime/algorithm/slime_formats.py).
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
from slime.algorithm import slime_formats
from slime.algorithm.slime_formats import LossHookInputs
from slime.backends.training.batching import MicroBatch, concat_on_device, is_on, pad_per_token, rows_on_device
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
    # a loss hook that reads LossInputs.hook_inputs is set (`slime_formats.loss_hooks_set`, resolved at the rank's init)
    loss_hooks: bool = False

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
        return compute_actor_loss(args, self.loss_inputs(rows, mb, log_probs, entropy, denominator, logits))

    def loss_inputs(self, rows: list[int], mb: MicroBatch, log_probs: torch.Tensor, entropy: torch.Tensor,
                    denominator: float, logits: torch.Tensor | None = None) -> LossInputs:
        """The loss's inputs of one micro-batch: padded `[B, R]` per-token values, the step's denominator and the
        rollouts' mask sums; what only slime's loss hooks read (the rows' lengths and tokens, the logits, the
        teacher's log-probs) only when one is set (`loss_hooks`)."""
        device = log_probs.device
        padded = functools.partial(padded_rows, rows=rows, width=mb.max_response_len, device=device)
        mask = mb.response_mask.to(device) * padded(self.loss_masks)
        sample_denominators = None
        if self.mask_sums is not None:
            sample_denominators = torch.tensor([self.mask_sums[r] for r in rows], dtype=torch.float32, device=device)
        hook_inputs = None
        if self.loss_hooks:
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
        found = dict(zip(rows, rows_on_device([batch.rollout_log_probs[r] for r in rows], device)))
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
    return dict(zip(rows, rows_on_device([batch.teacher_log_probs[r] for r in rows], device)))


def require_ref(args: Any, has_ref: bool) -> None:
    if (args.use_kl_loss or args.kl_coef) and not has_ref:
        raise ValueError("--use-kl-loss / --kl-coef need the reference model, but the actor was initialised "
                         "without one (with_ref=False); the actor group must pass with_ref=True")


def per_row_list(values: PerRow | None, rows: list[int], device=None, copy: bool = False
                 ) -> list[torch.Tensor] | None:
    """`values` of `rows` in order, fp32 on `device` (None: where each tensor is), copies with `copy`; None unless
    the record holds a value for every row (e.g. no old log-probs off the last pipeline stage)."""
    if values is None or not all(r in values for r in rows):
        return None
    tensors = [values[r].detach() for r in rows]
    if device is not None and (copy or not all(is_on(t, device) for t in tensors)):
        return rows_on_device(tensors, device)  # one copy for all rows (views of new storage)
    return [t.to(torch.float32, copy=copy) for t in tensors]


def slime_rollout_data(record: RolloutRecord, kl: list[torch.Tensor] | None = None,
                       values: list[torch.Tensor] | None = None, device=None) -> dict[str, Any]:
    """slime's `rollout_data` of this rank's rows (slime/algorithm/slime_formats.py `rollout_data`), from the batch
    and copies of the record's tensors on `device` (None: where each is; a hook editing them leaves the record
    alone); `kl` and `values` as the advantage step gives them."""
    batch, rows = record.batch, record.rows
    copies = functools.partial(per_row_list, rows=rows, device=device, copy=True)
    return slime_formats.rollout_data(
        partition=list(rows), tokens=[torch.as_tensor(batch.tokens[r], dtype=torch.long) for r in rows],
        response_lengths=[batch.response_lengths[r] for r in rows],
        total_lengths=[len(batch.tokens[r]) for r in rows], rewards=[batch.rewards[r] for r in rows],
        raw_reward=list(batch.raw_rewards), truncated=[int(batch.truncated[r]) for r in rows],
        loss_masks=copies(record.loss_masks), kl=kl, values=values, log_probs=copies(record.old_log_probs),
        ref_log_probs=copies(record.ref_log_probs), rollout_log_probs=copies(record.rollout_log_probs),
        advantages=copies(record.advantages), returns=copies(record.returns),
        group_indices=[batch.group_indices[r] for r in rows], teacher_log_probs=copies(record.teacher_log_probs),
        entropies={key: known for key, per_row in record.entropies.items() if (known := copies(per_row)) is not None},
    )


def advantages_and_returns(args: Any, record: RolloutRecord, values, device, group=None) -> None:
    """Fill the record's advantages (whitened over `group` with --normalize-advantages) and returns, computed on
    the CPU from the estimators' view of the record (`AdvantageInputs`) with the KL of the old policy to the
    reference (when one runs) and the critic's `values` (per row of the batch); a custom advantage function gets
    `slime_rollout_data`. With --use-opd the teacher's reverse KL enters the advantages before the whitening
    (slime/algorithm/opd.py). With --disable-compute-advantages-and-returns both stay None, as in slime (a custom
    loss then finds `advantages` None)."""
    if not args.compute_advantages_and_returns:  # slime's --disable-compute-advantages-and-returns: none at all
        record.advantages = record.returns = None
        return
    batch, rows = record.batch, record.rows
    on_cpu = functools.partial(per_row_list, rows=rows, device="cpu")
    old_log_probs, ref_log_probs = on_cpu(record.old_log_probs), on_cpu(record.ref_log_probs)
    inputs = AdvantageInputs(
        rewards=[batch.rewards[r] for r in rows], response_lengths=[batch.response_lengths[r] for r in rows],
        loss_masks=on_cpu(record.loss_masks), total_lengths=[len(batch.tokens[r]) for r in rows])
    if ref_log_probs is not None and old_log_probs is not None:  # (None: the training forward gives them, later)
        inputs.kl = [compute_approx_kl(old, ref, args.kl_loss_type) for old, ref in zip(old_log_probs, ref_log_probs)]
    if values is not None:
        inputs.values = [torch.as_tensor(values[r], dtype=torch.float32) for r in rows]
    adv_list, ret_list = compute_advantages_and_returns(
        args, inputs, lambda kl: slime_rollout_data(record, kl, inputs.values, "cpu"))
    if args.use_opd:
        teacher_log_probs = on_cpu(record.teacher_log_probs)
        if teacher_log_probs is None:
            raise ValueError(missing_teacher_message(args.opd_type))
        adv_list, reverse_kls = opd_advantages(adv_list, old_log_probs, teacher_log_probs, args.opd_kl_coef)
        record.opd_reverse_kl = dict(zip(rows, rows_on_device(reverse_kls, device)))
    if args.normalize_advantages:
        adv_list = whiten(adv_list, inputs.loss_masks, device, group)
    record.advantages = dict(zip(rows, rows_on_device(adv_list, device)))
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
    rows = list(old_lp)
    lp, rollout, mask = (concat_on_device([per_row[r] for r in rows], device, torch.float64)[0]
                         for per_row in (old_lp, rollout_lp, masks))
    total = torch.stack([((lp - rollout).abs() * mask).sum(), mask.sum()])
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1].clamp_min(1.0))


def token_mean(values: PerRow, device, group=None) -> float:
    """Mean of per-token values over every response token of the batch (all data-parallel ranks' rows; not
    loss-masked: a rollout-side figure, such as the engine's entropy, covers every generated token)."""
    flat, _ = concat_on_device(list(values.values()), device, torch.float64)
    total = torch.stack([flat.sum(), torch.full((), float(flat.numel()), dtype=torch.float64, device=device)])
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1].clamp_min(1.0))


def loss_denominator(args: Any, batch: TrainBatch, global_rows) -> float:
    """The step's (`global_rows`, every rank's) loss denominator: per-sample mean, its rollouts (slime's
    step_global_batch_size: --global-batch-size); --calculate-per-token-loss: its loss-masked tokens."""
    if args.calculate_per_token_loss:
        return max(1, sum(sum(batch.loss_masks[r]) for r in global_rows))
    rollout_of = batch.rollout_of_rows()
    return len({rollout_of[r] for r in global_rows})
