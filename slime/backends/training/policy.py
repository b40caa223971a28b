"""`PolicyTrainer`: one rollout's policy update, the same for every training backend.

    train(rollout_id, batch[, values]):
      1. plan: this data-parallel rank's rows of each optimizer step, in micro-batches;
      2. log-probs: the engines' (from the batch), the old policy's (recomputed — with --keep-old-actor by the
         weights the engines generated with, old_actor.py —, the engines' with --use-rollout-logprobs, or the
         training forward's own when one optimizer step covers the rollout and no reference model,
         distillation or --use-rollout-entropy runs), the reference model's and, with --use-opd, the teacher's
         (the batch's with --opd-type sglang, the trainer-held teacher model's with --opd-type megatron);
      3. advantages and returns (slime/algorithm/estimators.py; --use-opd's reverse KL, slime/algorithm/opd.py;
         whitened across ranks);
      4. --rollout-data-postprocess-path: fn(args, rollout_id, rollout_data) may edit them (rollout_data.py);
      5. one optimizer step per `--global-batch-size` rollouts (the rows split from one rollout stay in one step
         and weigh as one sample: batching.py), skipped for the first --num-critic-only-steps;
      6. metrics averaged over the steps; every --ref-update-interval rollouts the reference model takes the
         actor's weights.
    update_weights(engines, version): the backend's push, then --keep-old-actor's queue moves on.

A backend subclasses it and supplies the mechanics: `data_parallel()`, `plan(tokens, rows, log_probs)`,
`log_probs_of_rows(model, batch, micro_batches, store_prefix)`, `optimizer_step(record, step_id)`,
`copy_actor_to_ref()`, `push_weights(engines, version)`, for --keep-old-actor `weight_tensors()` (and
`after_weights_loaded()`), and, with pipeline stages, `last_stage()` / `from_last_stage(obj)`. It sets `self.args`,
`self.device`, `self.model`, `self.ref_model` (None without a KL term), `self.teacher_model` (--use-opd --opd-type
megatron: the teacher loaded from --opd-teacher-load; else None) in `init`, then calls `init_policy_hooks()`.
With LoRA the reference is the policy's own frozen base: the backend sets `self.base_is_reference` instead of
building `ref_model`, and supplies `adapters_off()`, under which the reference pass runs the policy model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from slime.algorithm.slime_formats import loss_hooks_set
from slime.backends.training.actor import TrainRayActor
from slime.backends.training.batching import rollout_mask_sums, rows_on_device, rows_per_step, step_rows
from slime.backends.training.old_actor import OldActor
from slime.backends.training.optimizer_state import reset_optimizer_states
from slime.backends.training.record import (
    RolloutRecord,
    advantages_and_returns,
    batch_teacher_log_probs,
    logprob_abs_diff,
    loss_denominator,
    require_ref,
    rollout_log_probs,
    token_mean,
)
from slime.backends.training.rollout_data import apply_rollout_data, rollout_data_of
from slime.observability.train_data_utils import save_debug_train_data
from slime.utils.hooks import hooks_of
from slime.utils.progress import progress
from slime.utils.types import TrainBatch

ABS_DIFF = "train/train_rollout_logprob_abs_diff"


class PolicyTrainer(TrainRayActor):
    args: Any
    device: torch.device
    model: Any
    ref_model: Any = None
    base_is_reference: bool = False  # LoRA with a KL term: the reference pass is the policy with its adapters off
    teacher_model: Any = None
    old_actor: OldActor | None = None
    rollout_data_postprocess: Any = None
    _returns: list[list[float]] | None = None

    # ---- backend hooks -------------------------------------------------------------------------------------
    def data_parallel(self) -> tuple[int, int, Any]:
        """(rank, size, process group) of this rank's data-parallel group."""
        raise NotImplementedError

    def plan(self, tokens: list[list[int]], rows: list[int], log_probs: bool = False) -> list[list[int]]:
        """Micro-batches of `rows` (forward-only passes may take a larger token budget)."""
        raise NotImplementedError

    def log_probs_of_rows(self, model: Any, batch: TrainBatch, micro_batches: list[list[int]], store_prefix: str,
                          entropy: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """{row: response log-probs} of `model` (no gradient); {} where they are not available (off the last
        pipeline stage). `store_prefix` names the pass (its key prefix in the batch): "" the old policy, "ref_" the
        reference, "teacher_" the distillation teacher. `entropy` (--use-rollout-entropy), when given, is filled
        with {row: response entropies} of the same softmax."""
        raise NotImplementedError

    def optimizer_step(self, record: RolloutRecord, step_id: int) -> dict[str, float]:
        """Forward and backward every micro-batch of `record.steps[step_id]` through `record.micro_batch_loss`
        (denominator `record.denominators[step_id]`), one optimizer step; the step's metrics summed over the
        data-parallel ranks, plus train/grad_norm and train/lr."""
        raise NotImplementedError

    def copy_actor_to_ref(self) -> None:
        raise NotImplementedError

    def adapters_off(self):
        """LoRA (`base_is_reference`): a context under which the policy model computes its frozen base alone."""
        raise NotImplementedError

    def push_weights(self, engines: list[Any], weight_version: int) -> None:
        """Collective: the current weights to every engine (the backend's `update_weights`)."""
        raise NotImplementedError

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """--keep-old-actor: this rank's weight tensors by name, live (writing them changes the model)."""
        raise NotImplementedError

    def after_weights_loaded(self) -> None:
        """--keep-old-actor: called after `weight_tensors()` were overwritten (e.g. to drop cached copies)."""

    def log_prob_plan(self, record: RolloutRecord) -> list[list[int]]:
        """Micro-batches of the forward-only passes (old and reference log-probs) over this rank's rows."""
        return self.plan(record.batch.tokens, record.rows, log_probs=True)

    def last_stage(self) -> bool:
        return True

    def from_last_stage(self, obj):
        return obj

    # ---- set-up and weight pushes ------------------------------------------------------------------------------
    def init_policy_hooks(self) -> None:
        """The end of a backend's `init`: this rank's plugin hooks (`slime.utils.hooks`; the megatron backend
        resolved them at the start of its `init`), --rollout-data-postprocess-path among them; copy the weights for
        --keep-old-actor."""
        args = self.args
        self.rollout_data_postprocess = hooks_of(args).rollout_data_postprocess
        self.loss_hooks = loss_hooks_set(args)  # slime's loss hooks: their inputs are built per micro-batch
        if args.keep_old_actor:
            self.old_actor = OldActor(self.weight_tensors, args.update_weights_interval, self.after_weights_loaded)

    def update_weights(self, engines: list[Any], weight_version: int) -> None:
        self.push_weights(engines, weight_version)
        if self.old_actor is not None:
            self.old_actor.pushed()

    # ---- the rollout --------------------------------------------------------------------------------------
    def train(self, rollout_id: int, batch: TrainBatch, values: list[list[float]] | None = None) -> dict[str, float]:
        """One rollout's policy update. `values`: a critic's per-token values of every row (ppo); the returns
        computed from them are then available from `get_returns`."""
        args = self.args
        record = self.prepare(rollout_id, batch, values)
        extra: dict[str, float] = {}
        recomputed = record.old_log_probs is not None and not args.use_rollout_logprobs
        if recomputed and record.rollout_log_probs is not None and self.last_stage():
            extra[ABS_DIFF] = self._abs_diff(record)
        if record.entropies and self.last_stage():
            group = self.data_parallel()[2]
            extra.update({f"rollout/{key}": token_mean(values, self.device, group)
                          for key, values in record.entropies.items()})
        if rollout_id < args.num_critic_only_steps:
            extra["train/critic_only_step"] = 1.0
            self._save_train_data(record)
            return self.from_last_stage(extra)

        if args.reset_optimizer_states or args.use_stateless_adam:
            self.optimizer_ready()  # the resets below write the optimizer's state
        if args.reset_optimizer_states:  # the rollout starts from a fresh optimizer history
            reset_optimizer_states(self.train_state().optimizers)
        totals: dict[str, float] = defaultdict(float)
        with progress(len(record.rows), f"train {rollout_id}", "sample", enabled=self.rank == 0) as bar:
            for s, micro_batches in enumerate(record.steps):
                if args.use_stateless_adam:  # every step is a fresh Adam's first (slime's StatelessAdam update)
                    reset_optimizer_states(self.train_state().optimizers)
                step_metrics = self.optimizer_step(record, s)
                bar.update(sum(map(len, micro_batches)))
                for k, v in step_metrics.items():
                    totals[k] += v
        if record.reuse_training_forward and record.rollout_log_probs is not None and self.last_stage():
            extra[ABS_DIFF] = self._abs_diff(record)
        metrics = {k: v / len(record.steps) for k, v in totals.items()}
        metrics.update(extra)
        self._save_train_data(record)
        interval = args.ref_update_interval
        if interval and (rollout_id + 1) % interval == 0 and self.ref_model is not None:
            self.copy_actor_to_ref()
            metrics["train/ref_updated"] = 1.0
        return self.from_last_stage(metrics)

    def prepare(self, rollout_id: int, batch: TrainBatch, values: list[list[float]] | None) -> RolloutRecord:
        """Steps 1-4 of the module docstring: the record the optimizer steps read."""
        args = self.args
        dp_rank, dp_size, dp_group = self.data_parallel()
        steps = rows_per_step(len(batch), args.global_batch_size, dp_size, dp_rank,
                              [len(t) for t in batch.tokens] if args.balance_data else None, batch.rollout_ids)
        record = RolloutRecord(batch, [self.plan(batch.tokens, rows) for rows in steps], rollout_id,
                               loss_hooks=self.loss_hooks)
        record.denominators = [loss_denominator(args, batch, rows)
                               for rows in step_rows(len(batch), args.global_batch_size, batch.rollout_ids)]
        record.mask_sums = rollout_mask_sums(batch.loss_masks, batch.rollout_of_rows())
        record.loss_masks = dict(zip(record.rows, rows_on_device([batch.loss_masks[r] for r in record.rows],
                                                                 self.device)))
        record.rollout_log_probs = rollout_log_probs(args, batch, record.rows, self.device)
        has_ref = self.ref_model is not None or self.base_is_reference
        require_ref(args, has_ref)
        # One optimizer step: the policy that generated the log-probs of the loss is still the trained one, so the
        # training forward's own log-probs (detached) are the old ones (one forward fewer). slime's rule: not when
        # the advantages need them first (the KL of the token rewards, --kl-coef against the reference; the KL loss
        # of --use-kl-loss is the training forward's own; --use-opd's teacher term), not with a critic (ppo), not
        # with --keep-old-actor, whose old policy is another set of weights. Here also not with
        # --use-rollout-entropy, which asks for the old policy's entropies before training (slime skips them when
        # it reuses the forward).
        record.reuse_training_forward = (len(steps) == 1 and not (has_ref and args.kl_coef)
                                         and not args.use_rollout_logprobs and self.old_actor is None
                                         and not args.use_opd and not args.use_critic
                                         and not args.use_rollout_entropy)
        forward_only = None
        if (not (args.use_rollout_logprobs or record.reuse_training_forward) or has_ref
                or self.teacher_model is not None):
            forward_only = self.log_prob_plan(record)
        if self.ref_model is not None:
            record.ref_log_probs = self._log_prob_pass(record, self.ref_model, forward_only, "ref_")
        elif self.base_is_reference:
            with self.adapters_off():
                record.ref_log_probs = self._log_prob_pass(record, self.model, forward_only, "ref_")
        if self.teacher_model is not None:
            record.teacher_log_probs = self._log_prob_pass(record, self.teacher_model, forward_only, "teacher_")
        elif args.use_opd and args.compute_advantages_and_returns:
            record.teacher_log_probs = batch_teacher_log_probs(args, batch, record.rows, self.device)
        if args.use_rollout_logprobs:
            record.old_log_probs = record.rollout_log_probs
        elif self.old_actor is not None:
            with self.old_actor.loaded():
                record.old_log_probs = self._log_prob_pass(record, self.model, forward_only, "")
        elif not record.reuse_training_forward:
            record.old_log_probs = self._log_prob_pass(record, self.model, forward_only, "")
        if self.last_stage():
            advantages_and_returns(args, record, values, self.device, dp_group)
        if self.rollout_data_postprocess is not None:
            self._postprocess(record)
        return record

    def _log_prob_pass(self, record: RolloutRecord, model: Any, micro_batches: list[list[int]], store_prefix: str
                       ) -> dict[int, torch.Tensor]:
        """One forward-only log-prob pass; with --use-rollout-entropy its entropies are kept in the record under
        slime's rollout_data key (`store_prefix` + "entropy")."""
        if not self.args.use_rollout_entropy:
            return self.log_probs_of_rows(model, record.batch, micro_batches, store_prefix)
        entropy: dict[int, torch.Tensor] = {}
        log_probs = self.log_probs_of_rows(model, record.batch, micro_batches, store_prefix, entropy)
        record.entropies[f"{store_prefix}entropy"] = entropy
        return log_probs

    def _save_train_data(self, record: RolloutRecord) -> None:
        """--save-debug-train-data: what this rollout's training read, with its step / micro-batch layout (slime's
        format; collective: every rank calls it, `save_debug_train_data` decides who writes)."""
        if self.args.save_debug_train_data is None:
            return
        data = rollout_data_of(record)  # after training: the training forward's log-probs when it was reused
        position = iter(range(len(record.rows)))
        data["micro_batch_indices"] = [[next(position) for _ in mb] for step in record.steps for mb in step]  # slime's
        data["num_microbatches"] = [len(step) for step in record.steps]
        data["global_batch_sizes"] = [self.args.global_batch_size] * len(record.steps)
        save_debug_train_data(self.args, rollout_id=record.rollout_id, rollout_data=data)

    def _postprocess(self, record: RolloutRecord) -> None:
        data = rollout_data_of(record)
        given = set(data)
        self.rollout_data_postprocess(self.args, record.rollout_id, data)
        apply_rollout_data(record, data, given, self.args.rollout_data_postprocess_path)

    def _abs_diff(self, record: RolloutRecord) -> float:
        return logprob_abs_diff(record.old_log_probs, record.rollout_log_probs, record.loss_masks, self.device,
                                self.data_parallel()[2])
