"""The per-micro-batch loss of the actor (`--loss-type`) and of the PPO critic, on padded `[B, R]` tensors.

Backend-agnostic: it only sees tensors and `args`; the math is in slime/utils/ppo_utils.py. Every returned
metric is this micro-batch's share of a global-batch value (see `ppo_utils.aggregate_loss`), so summing the
shares over micro-batches and ranks gives the global figure.

`--loss-type custom_loss` calls `--custom-loss-function-path fn(args, inputs: LossInputs) -> (loss,
metrics)`: `loss` a scalar tensor that is this micro-batch's share of the global loss (use
`inputs.aggregate`), `metrics` a dict of scalar tensors named like `train/<name>` (shares too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slime.algorithm.estimators import estimator_of
from slime.utils import ppo_utils
from slime.utils.misc import load_function

LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")


@dataclass
class LossInputs:
    """One micro-batch, response-aligned `[B, R]`; `mask` already includes the loss masks."""

    log_probs: torch.Tensor  # current policy, with gradient
    old_log_probs: torch.Tensor  # behaviour policy (recomputed, or the rollout's with --use-rollout-logprobs)
    advantages: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor  # per-token entropy of the current policy, with gradient
    ref_log_probs: torch.Tensor | None = None  # when a reference model runs
    rollout_log_probs: torch.Tensor | None = None  # when the rollout returned log-probs
    # [B, R] -> scalar share of the global aggregate (per-sample mean, or per-token with --calculate-per-token-loss)
    aggregate: Callable[[torch.Tensor], torch.Tensor] | None = None


def compute_actor_loss(args: Any, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss_type = args.loss_type
    if loss_type == "policy_loss":
        loss, metrics = policy_loss(args, inputs)
    elif loss_type == "sft_loss":
        loss, metrics = sft_loss(args, inputs)
    elif loss_type == "custom_loss":
        fn = load_function(args.custom_loss_function_path, "--custom-loss-function-path")
        loss, metrics = fn(args, inputs)
        metrics = dict(metrics)
    else:
        raise ValueError(f"--loss-type {loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    metrics = {k: v.detach() for k, v in metrics.items()}
    metrics["train/loss"] = loss.detach()
    return loss, metrics


def policy_loss(args: Any, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg_loss (the estimator's: PPO clip / GSPO / CISPO, × TIS weight) − entropy_coef·entropy
    (+ kl_loss_coef·KL)."""
    agg = inputs.aggregate
    lp, old = inputs.log_probs, inputs.old_log_probs
    pg, clipfrac, ppo_kl = estimator_of(args).policy_loss(lp, old, inputs.advantages, inputs.mask, args)
    metrics = {"train/pg_clipfrac": agg(clipfrac), "train/ppo_kl": agg(ppo_kl)}
    if args.use_tis:
        if inputs.rollout_log_probs is None:
            raise ValueError("--use-tis: no rollout log-probs in the batch (the rollout function must fill "
                             "Sample.rollout_log_probs); drop the flag or return them")
        weights, tis_clipped = ppo_utils.compute_tis_weights(old, inputs.rollout_log_probs, args.tis_clip,
                                                             args.tis_clip_low)
        pg = pg * weights
        metrics.update({"train/tis": agg(weights), "train/tis_clipfrac": agg(tis_clipped)})
    pg_loss = agg(pg)
    entropy_coef = args.entropy_coef
    entropy_loss = agg(inputs.entropy if entropy_coef else inputs.entropy.detach())
    loss = pg_loss - entropy_coef * entropy_loss
    metrics.update({"train/pg_loss": pg_loss, "train/entropy_loss": entropy_loss})
    if inputs.ref_log_probs is not None:
        # Reported whenever a reference model runs (also under --kl-coef reward shaping); in the loss only
        # with --use-kl-loss.
        kl = ppo_utils.compute_approx_kl(lp, inputs.ref_log_probs, args.kl_loss_type)
        if args.use_unbiased_kl:
            kl = ppo_utils.unbiased_kl(kl, lp, old)
        kl_loss = agg(kl)
        if args.use_kl_loss:
            loss = loss + args.kl_loss_coef * kl_loss
        metrics["train/kl_loss"] = kl_loss
    return loss, metrics


def sft_loss(args: Any, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the loss-masked response tokens (aggregated like the policy loss)."""
    loss = inputs.aggregate(-inputs.log_probs)
    return loss, {"train/sft_loss": loss, "train/entropy_loss": inputs.aggregate(inputs.entropy.detach())}


def critic_loss(
    args: Any, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
    aggregate: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO value loss (`--value-clip`) and its metrics."""
    per_token, clipfrac = ppo_utils.compute_value_loss(values, old_values, returns, args.value_clip)
    loss = aggregate(per_token)
    return loss, {"train/value_loss": loss.detach(), "train/value_clipfrac": aggregate(clipfrac),
                  "critic/values": aggregate(values.detach()), "critic/returns": aggregate(returns)}
