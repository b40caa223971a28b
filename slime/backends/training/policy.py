"""`PolicyTrainer`: one rollout's policy update, the same for every training backend.

    train(rollout_id, batch[, values]):
      1. plan: this data-parallel rank's rows of each optimizer step, in micro-batches;
      2. log-probs: the engines' (from the batch), the old policy's (recomputed, the engines' with
         --use-rollout-logprobs, or the training forward's own when one optimizer step covers the rollout and no
         reference model runs) and the reference model's;
      3. advantages and returns (slime/algorithm/estimators.py; whitened across ranks);
      4. one optimizer step per `--global-batch-size` rows (skipped for the first --num-critic-only-steps);
      5. metrics averaged over the steps; every --ref-update-interval rollouts the reference model takes the
         actor's weights.

A backend subclasses it and supplies the mechanics: `data_parallel()`, `plan(tokens, rows, log_probs)`,
`log_probs_of_rows(model, batch, micro_batches)`, `optimizer_step(record, micro_batches, denominator)`,
`copy_actor_to_ref()`, and, with pipeline stages, `last_stage()` / `from_last_stage(obj)`. It sets `self.args`,
`self.device`, `self.model`, `self.ref_model` (None without a KL term) in `init`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from slime.backends.training.actor import TrainRayActor
from slime.backends.training.batching import rows_per_step
from slime.backends.training.record import (
    RolloutRecord,
    advantages_and_returns,
    logprob_abs_diff,
    loss_denominator,
    require_ref,
    rollout_log_probs,
)
from slime.utils.progress import progress
from slime.utils.types import TrainBatch

ABS_DIFF = "train/train_rollout_logprob_abs_diff"


class PolicyTrainer(TrainRayActor):
    args: Any
    device: torch.device
    model: Any
    ref_model: Any = None
    _returns: list[list[float]] | None = None

    # ---- backend hooks -------------------------------------------------------------------------------------
    def data_parallel(self) -> tuple[int, int, Any]:
        """(rank, size, process group) of this rank's data-parallel group."""
        raise NotImplementedError

    def plan(self, tokens: list[list[int]], rows: list[int], log_probs: bool = False) -> list[list[int]]:
        """Micro-batches of `rows` (forward-only passes may take a larger token budget)."""
        raise NotImplementedError

    def log_probs_of_rows(self, model: Any, batch: TrainBatch, micro_batches: list[list[int]]
                          ) -> dict[int, torch.Tensor]:
        """{row: response log-probs} of `model` (no gradient); {} where they are not available (off the last
        pipeline stage)."""
        raise NotImplementedError

    def optimizer_step(self, record: RolloutRecord, micro_batches: list[list[int]], denominator: float
                       ) -> dict[str, float]:
        """Forward and backward every micro-batch through `record.micro_batch_loss`, one optimizer step; the
        step's metrics summed over the data-parallel ranks, plus train/grad_norm and train/lr."""
        raise NotImplementedError

    def copy_actor_to_ref(self) -> None:
        raise NotImplementedError

    def log_prob_plan(self, record: RolloutRecord) -> list[list[int]]:
        """Micro-batches of the forward-only passes (old and reference log-probs) over this rank's rows."""
        return self.plan(record.batch.tokens, record.rows, log_probs=True)

    def last_stage(self) -> bool:
        return True

    def from_last_stage(self, obj):
        return obj

    # ---- the rollout --------------------------------------------------------------------------------------
    def train(self, rollout_id: int, batch: TrainBatch, values: list[list[float]] | None = None) -> dict[str, float]:
        """One rollout's policy update. `values`: a critic's per-token values of every row (ppo); the returns
        computed from them are then available from `get_returns`."""
        args = self.args
        record = self.prepare(batch, values)
        extra: dict[str, float] = {}
        recomputed = record.old_log_probs is not None and not args.use_rollout_logprobs
        if recomputed and record.rollout_log_probs is not None and self.last_stage():
            extra[ABS_DIFF] = self._abs_diff(record)
        if rollout_id < args.num_critic_only_steps:
            extra["train/critic_only_step"] = 1.0
            return self.from_last_stage(extra)

        totals: dict[str, float] = defaultdict(float)
        with progress(len(record.rows), f"train {rollout_id}", "sample", enabled=self.rank == 0) as bar:
            for s, micro_batches in enumerate(record.steps):
                global_rows = range(s * args.global_batch_size, (s + 1) * args.global_batch_size)
                step_metrics = self.optimizer_step(record, micro_batches, loss_denominator(args, batch, global_rows))
                bar.update(sum(map(len, micro_batches)))
                for k, v in step_metrics.items():
                    totals[k] += v
        if record.reuse_training_forward and record.rollout_log_probs is not None and self.last_stage():
            extra[ABS_DIFF] = self._abs_diff(record)
        metrics = {k: v / len(record.steps) for k, v in totals.items()}
        metrics.update(extra)
        interval = args.ref_update_interval
        if interval and (rollout_id + 1) % interval == 0 and self.ref_model is not None:
            self.copy_actor_to_ref()
            metrics["train/ref_updated"] = 1.0
        return self.from_last_stage(metrics)

    def prepare(self, batch: TrainBatch, values: list[list[float]] | None) -> RolloutRecord:
        """Steps 1-3 of the module docstring: the record the optimizer steps read."""
        args = self.args
        dp_rank, dp_size, dp_group = self.data_parallel()
        steps = rows_per_step(len(batch), args.global_batch_size, dp_size, dp_rank,
                              [len(t) for t in batch.tokens] if args.balance_data else None)
        record = RolloutRecord(batch, [self.plan(batch.tokens, rows) for rows in steps])
        record.rollout_log_probs = rollout_log_probs(args, batch, record.rows, self.device)
        require_ref(args, self.ref_model is not None)
        # One optimizer step and no reference model: the policy that generated the log-probs of the loss is still
        # the trained one, so the training forward's own log-probs (detached) are the old ones (one forward fewer).
        record.reuse_training_forward = (len(steps) == 1 and self.ref_model is None and not args.use_rollout_logprobs)
        forward_only = None
        if not (args.use_rollout_logprobs or record.reuse_training_forward) or self.ref_model is not None:
            forward_only = self.log_prob_plan(record)
        if args.use_rollout_logprobs:
            record.old_log_probs = record.rollout_log_probs
        elif not record.reuse_training_forward:
            record.old_log_probs = self.log_probs_of_rows(self.model, batch, forward_only)
        if self.ref_model is not None:
            record.ref_log_probs = self.log_probs_of_rows(self.ref_model, batch, forward_only)
        if self.last_stage():
            advantages_and_returns(args, record, values, self.device, dp_group)
        return record

    def _abs_diff(self, record: RolloutRecord) -> float:
        return logprob_abs_diff(record.old_log_probs, record.rollout_log_probs, record.batch, self.device,
                                self.data_parallel()[2])
