"""The per-micro-batch loss of the actor (`--loss-type`) and of the PPO critic, on padded `[B, R]` tensors.

Backend-agnostic: it only sees tensors and `args`; the math is in slime/algorithm/objectives.py. Every returned
metric is this micro-batch's share of a global-batch value (`global_share`), so summing the shares over
micro-batches and ranks gives the global figure: by default the mean over the step's rollouts of each rollout's
token mean (a rollout split into several rows weighs as one, as in slime), with --calculate-per-token-loss the
step's token mean.

slime's loss hooks are called here, where slime calls them, with slime's arguments; they see slime's flat /
per-sample layout (the rows' response tokens back to back, or one [T_i] tensor per sample), converted from and
back to the padded rows by `SampleLayout` from what only they read, `LossInputs.hook_inputs`, which the trainer
builds only when one of them is set (slime/algorithm/slime_formats.py):
- `--custom-tis-function-path fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
  response_lengths, **kw) -> (pg_loss, loss_masks, metrics)` with `--use-tis` (slime/algorithm/tis.py);
- `--custom-pg-loss-reducer-function-path fn(total_lengths, response_lengths, loss_masks,
  calculate_per_token_loss) -> reducer`, the reducer of the flat pg_loss (a micro-batch sum, as slime's
  `sum_of_sample_mean`);
- `--loss-type custom_loss --custom-loss-function-path fn(args, batch, logits, sum_of_sample_mean) -> (loss,
  metrics)` (`loss_batch` lists the batch's keys). Its loss and metrics are micro-batch sums like slime's; they
  are divided here by the global denominator to become shares.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slime.algorithm import objectives
from slime.algorithm.estimators import estimator_of
from slime.algorithm.slime_formats import LossHookInputs, SampleLayout, loss_batch
from slime.utils.hooks import hooks_of

LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")


@dataclass
class LossInputs:
    """One micro-batch, response-aligned `[B, R]`; `mask` already includes the loss masks."""

    log_probs: torch.Tensor  # current policy, with gradient
    old_log_probs: torch.Tensor  # behaviour policy (recomputed, or the rollout's with --use-rollout-logprobs)
    advantages: torch.Tensor | None  # None with --disable-compute-advantages-and-returns
    mask: torch.Tensor
    entropy: torch.Tensor  # per-token entropy of the current policy, with gradient
    ref_log_probs: torch.Tensor | None = None  # when a reference model runs
    rollout_log_probs: torch.Tensor | None = None  # when the rollout returned log-probs
    # [B, R] -> scalar share of the global aggregate (per-sample mean, or per-token with --calculate-per-token-loss);
    # None: `global_share` of `global_denominator` and `sample_denominators`
    aggregate: Callable[[torch.Tensor], torch.Tensor] | None = None
    global_denominator: float | None = None  # rollouts (or masked tokens, per token) of the global batch
    # [B] what each row's masked sum is divided by in the per-sample mean: its rollout's loss-masked tokens (slime's
    # rollout_mask_sums); None: the row's own masked tokens
    sample_denominators: torch.Tensor | None = None
    opd_reverse_kl: torch.Tensor | None = None  # --use-opd: the reverse KL (student − teacher) in the advantages
    # What only slime's loss hooks read (lengths, tokens, [1, T, V] logits): built when `loss_hooks_set(args)`
    hook_inputs: LossHookInputs | None = None


def micro_batch_sum(values: torch.Tensor, mask: torch.Tensor, per_token: bool,
                    sample_denominators: torch.Tensor | None = None) -> torch.Tensor:
    """slime's `sum_of_sample_mean` of `[B, R]` values: with `per_token` Σ x·mask; else Σ over rows of the row's
    masked sum over its denominator (`sample_denominators`, slime's rollout_mask_sums; None: the row's own
    masked tokens, i.e. Σ of per-row means)."""
    if per_token or sample_denominators is None:
        return objectives.sum_of_sample_mean(values, mask, per_token)
    row_sums = (values * mask.to(values.dtype)).sum(-1)
    return (row_sums / sample_denominators.to(row_sums).clamp_min(1.0)).sum()


def global_share(values: torch.Tensor, mask: torch.Tensor, per_token: bool, global_denominator: float,
                 sample_denominators: torch.Tensor | None = None) -> torch.Tensor:
    """A micro-batch's share of a global-batch value: its `micro_batch_sum` over the global denominator (the
    step's rollouts, or with `per_token` its masked tokens), so the shares of all micro-batches and ranks sum
    to the step's mean over rollouts of each rollout's token mean (or its token mean)."""
    if global_denominator <= 0:
        raise ValueError(f"global_share: the global denominator must be > 0, got {global_denominator}")
    return micro_batch_sum(values, mask, per_token, sample_denominators) / global_denominator


def aggregate_of(args: Any, inputs: LossInputs) -> Callable[[torch.Tensor], torch.Tensor]:
    if inputs.aggregate is not None:
        return inputs.aggregate
    if inputs.global_denominator is None:
        raise ValueError("LossInputs: give `aggregate` or `global_denominator`")
    return functools.partial(global_share, mask=inputs.mask, per_token=args.calculate_per_token_loss,
                             global_denominator=inputs.global_denominator,
                             sample_denominators=inputs.sample_denominators)


def compute_actor_loss(args: Any, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss_type = args.loss_type
    if loss_type == "policy_loss":
        loss, metrics = policy_loss(args, inputs)
    elif loss_type == "sft_loss":
        loss, metrics = sft_loss(args, inputs)
    elif loss_type == "custom_loss":
        loss, metrics = custom_loss(args, inputs)
    else:
        raise ValueError(f"--loss-type {loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    metrics = {k: v.detach() for k, v in metrics.items()}
    metrics["train/loss"] = loss.detach()
    return loss, metrics


def policy_loss(args: Any, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg_loss (the estimator's: PPO clip / GSPO / CISPO, off-policy sequences masked with --use-opsm,
    importance-corrected with --use-tis, reduced by
    --custom-pg-loss-reducer-function-path when given) − entropy_coef·entropy (+ kl_loss_coef·KL)."""
    agg = aggregate_of(args, inputs)
    lp, old = inputs.log_probs, inputs.old_log_probs
    pg, clipfrac, ppo_kl = estimator_of(args).policy_loss(lp, old, inputs.advantages, inputs.mask, args)
    metrics = {"train/pg_clipfrac": agg(clipfrac), "train/ppo_kl": agg(ppo_kl)}
    if args.use_opsm:
        # Before the importance correction, so it (and a custom TIS function) sees the masked loss. The metric
        # is the share of dropped (loss-masked) tokens, reduced like the others: per sample, the fraction of
        # sequences dropped.
        keep = objectives.opsm_mask(lp, old, inputs.advantages, inputs.mask, args.opsm_delta)
        pg = pg * keep
        metrics["train/opsm_clipfrac"] = agg(1.0 - keep)
    pg_masks = None  # per-token masks a TIS / rejection-sampling function returned (None: the loss masks)
    if args.use_tis or args.get_mismatch_metrics:
        pg, pg_masks, tis_metrics = importance_correction(args, inputs, pg, ppo_kl)
        metrics.update({f"train/{name}": agg(value) for name, value in tis_metrics.items()})
    pg_loss = reduce_pg_loss(args, inputs, pg, pg_masks, agg)
    entropy_coef = args.entropy_coef
    entropy_loss = agg(inputs.entropy if entropy_coef else inputs.entropy.detach())
    loss = pg_loss - entropy_coef * entropy_loss
    metrics.update({"train/pg_loss": pg_loss, "train/entropy_loss": entropy_loss})
    if inputs.ref_log_probs is not None:
        # Reported whenever a reference model runs (also under --kl-coef reward shaping); in the loss only
        # with --use-kl-loss.
        ratio = torch.exp(lp - old) if args.use_unbiased_kl else None
        kl_loss = agg(objectives.compute_approx_kl(lp, inputs.ref_log_probs, args.kl_loss_type, importance_ratio=ratio))
        if args.use_kl_loss:
            loss = loss + args.kl_loss_coef * kl_loss
        metrics["train/kl_loss"] = kl_loss
    if inputs.opd_reverse_kl is not None:  # slime's OPD metric, reduced like the loss's terms
        metrics["train/opd_reverse_kl"] = agg(inputs.opd_reverse_kl)
    return loss, metrics


def importance_correction(args: Any, inputs: LossInputs, pg: torch.Tensor, ppo_kl: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """--use-tis (or --get-mismatch-metrics): the pg loss corrected for the rollout/training mismatch, by
    `--custom-tis-function-path` when given, else truncated importance sampling. Returns (pg [B, R], the
    function's modified masks [B, R] or None, per-token metrics [B, R] incl. slime's "ois" = exp(−ppo_kl))."""
    if inputs.rollout_log_probs is None:
        raise ValueError("--use-tis: no rollout log-probs in the batch (the rollout function must fill "
                         "Sample.rollout_log_probs); drop the flag or return them")
    metrics = {"ois": torch.exp(-ppo_kl).detach()}
    path = args.custom_tis_function_path
    if not path:
        weights, tis_metrics = objectives.tis_weights(inputs.old_log_probs, inputs.rollout_log_probs, args.tis_clip,
                                                     args.tis_clip_low)
        return pg * weights, None, {**metrics, **tis_metrics}
    flag = "--custom-tis-function-path"
    layout = SampleLayout(inputs, flag)
    out = hooks_of(args).custom_tis_function(
        args, pg_loss=layout.flat(pg), train_log_probs=layout.rows(inputs.old_log_probs),
        rollout_log_probs=layout.rows(inputs.rollout_log_probs), loss_masks=layout.rows(inputs.mask),
        total_lengths=layout.total_lengths, response_lengths=layout.lengths)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(f"{flag} {path}: returned {type(out).__name__}; slime's contract returns a tuple "
                         "(pg_loss, loss_masks, metrics)")
    flat_pg, masks, custom_metrics = out
    if len(masks) != len(layout.lengths):
        raise ValueError(f"{flag} {path}: returned {len(masks)} loss masks for {len(layout.lengths)} samples")
    pg_masks = layout.padded(torch.cat([torch.as_tensor(m, dtype=pg.dtype, device=pg.device) for m in masks]))
    metrics.update({name: layout.padded(torch.as_tensor(v)).detach() for name, v in custom_metrics.items()})
    # Rejected tokens leave the numerator; the denominators stay the loss masks' (a rejection lowers the
    # loss; the kept tokens are not renormalised).
    return layout.padded(flat_pg) * pg_masks, pg_masks, metrics


def reduce_pg_loss(args: Any, inputs: LossInputs, pg: torch.Tensor, pg_masks: torch.Tensor | None,
                   agg: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The pg loss's share: `--custom-pg-loss-reducer-function-path`'s reducer of the flat pg loss (built from the
    TIS function's masks when there are some, else the loss masks) over the global denominator, or `agg`."""
    path = args.custom_pg_loss_reducer_function_path
    if not path:
        return agg(pg)
    flag = "--custom-pg-loss-reducer-function-path"
    layout = SampleLayout(inputs, flag)
    masks = layout.rows(inputs.mask if pg_masks is None else pg_masks)
    reducer = hooks_of(args).custom_pg_loss_reducer_function(layout.total_lengths, layout.lengths, masks,
                                                             args.calculate_per_token_loss)
    return reducer(layout.flat(pg)) / layout.denominator


def custom_loss(args: Any, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`--custom-loss-function-path fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)`, slime's call:
    `sum_of_sample_mean` reduces a flat per-token tensor to the micro-batch's sum of sample means (or of tokens
    with --calculate-per-token-loss); the loss and each metric (named `train/<name>`) come back as such sums
    and are divided by the global denominator into shares."""
    flag = "--custom-loss-function-path"
    layout = SampleLayout(inputs, flag)
    per_token = args.calculate_per_token_loss

    def sum_of_sample_mean(flat: torch.Tensor) -> torch.Tensor:
        return micro_batch_sum(layout.padded(flat), inputs.mask, per_token, inputs.sample_denominators)

    out = hooks_of(args).custom_loss_function(args, loss_batch(inputs, layout), inputs.hook_inputs.logits,
                                              sum_of_sample_mean)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise ValueError(f"{flag} {args.custom_loss_function_path}: returned {type(out).__name__}; slime's contract "
                         "returns (loss, {name: scalar})")
    loss, reported = out
    metrics = {(k if k.startswith("train/") else f"train/{k}"): torch.as_tensor(v) / layout.denominator
               for k, v in reported.items()}
    return loss / layout.denominator, metrics


def sft_loss(args: Any, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the loss-masked response tokens (aggregated like the policy loss)."""
    agg = aggregate_of(args, inputs)
    loss = agg(-inputs.log_probs)
    return loss, {"train/sft_loss": loss, "train/entropy_loss": agg(inputs.entropy.detach())}


def critic_loss(
    args: Any, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
    aggregate: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO value loss (`--value-clip`) and its metrics."""
    per_token, clipfrac = objectives.compute_value_loss(values, old_values, returns, args.value_clip)
    loss = aggregate(per_token)
    return loss, {"train/value_loss": loss.detach(), "train/value_clipfrac": aggregate(clipfrac),
                  "critic/values": aggregate(values.detach()), "critic/returns": aggregate(returns)}
