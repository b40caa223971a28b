"""slime's `slime.backends.megatron_utils.loss`: the names plugins written for slime import from it, each our
implementation or a thin adapter onto it with slime's signature.

- `compute_advantages_and_returns(args, rollout_data)`: slime's dict-shaped advantage step
  (slime/algorithm/estimators.py `compute_advantages_and_returns_in_place`); under megatron-core's parallel groups
  it does nothing off the last pipeline stage and whitens (--normalize-advantages) across the data-parallel
  group with context parallelism, as slime;
- `vanilla_tis_function`, `icepop_function`: the `--custom-tis-function-path` functions (slime/algorithm/tis.py);
- `get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy)` and
  `get_values(logits, *, ...)`: per-sample response log-probs / entropies (at --rollout-temperature) or values,
  from logits in slime's layout, `[1, T, V]` with the micro-batch's sequences back to back, which is how a
  `--custom-loss-function-path` receives them here (slime/algorithm/slime_formats.py `LossHookInputs.logits`). On a megatron
  trainer the logits are vocab-parallel and the log-softmax is reduced over its tensor-parallel group
  (slime/backends/megatron_utils/forward.py); elsewhere the logits hold the whole vocabulary;
- `policy_loss_function(args, batch, logits, sum_of_sample_mean)`: slime's policy loss of a micro-batch dict,
  onto slime/algorithm/loss.py `policy_loss` (for custom losses that add a term to it).

Not here: these functions under context parallelism (refused: the logits hold each CP rank's zigzag chunks; the
trainer's own loss gathers per-token log-probs instead, forward.py) and slime's top-p replay arguments of
`get_log_probs_and_entropy` (refused); slime's other internals (CP helpers, value / SFT loss functions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slime.algorithm.estimators import compute_advantages_and_returns_in_place
from slime.algorithm.loss import LossInputs, policy_loss
from slime.algorithm.slime_formats import LossHookInputs
from slime.algorithm.tis import icepop_function, vanilla_tis_function
from slime.algorithm.log_probs import log_probs_and_entropy
from slime.backends.training.record import whiten
from slime.observability.context_parallel import cp_size_and_rank, parallel_state, tensor_parallel_group

__all__ = ["compute_advantages_and_returns", "get_log_probs_and_entropy", "get_values", "icepop_function",
           "policy_loss_function", "vanilla_tis_function"]


def compute_advantages_and_returns(args: Any, rollout_data: dict[str, Any]) -> None:
    """slime's call: sets rollout_data["kl"], ["advantages"] and ["returns"] (`compute_advantages_and_returns_in_place`).
    With megatron-core's parallel groups (and torch.distributed) up: nothing off the last pipeline stage, and the
    whitening's moments all-reduced over the data-parallel group with context parallelism; otherwise whitened
    over these rows."""
    mpu = parallel_state()
    if mpu is None or not dist.is_initialized():
        compute_advantages_and_returns_in_place(args, rollout_data)
        return
    if not mpu.is_pipeline_last_stage():
        return
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    device = "cuda" if torch.cuda.is_available() and dist.get_backend(group) == "nccl" else "cpu"

    def across_ranks(advantages: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
        return whiten(advantages, masks, device, group)

    compute_advantages_and_returns_in_place(args, rollout_data, whiten=across_ranks)


def _response_rows(logits: torch.Tensor, total_lengths: list[int], response_lengths: list[int], who: str
                   ) -> torch.Tensor:
    """The `[N, V]` fp32 rows of `[1, T, V]` logits that predict the response tokens, sample after sample
    (response token t of a sample ending at position e is predicted at e − response_length − 1 + t)."""
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"{who}: logits of shape {tuple(logits.shape)}; slime's layout is [1, T, V], the "
                         "micro-batch's sequences back to back")
    if sum(total_lengths) > logits.shape[1]:
        raise ValueError(f"{who}: the samples hold {sum(total_lengths)} tokens (total_lengths {total_lengths}) but "
                         f"the logits cover {logits.shape[1]} positions")
    if cp_size_and_rank()[0] > 1:
        raise ValueError(f"{who}: not implemented with --context-parallel-size > 1 (each rank holds zigzag chunks of "
                         "the sequences); use the batch's cur_log_probs / entropy instead")
    positions, end = [], 0
    for total, n in zip(total_lengths, response_lengths, strict=True):
        end += total
        positions.extend(range(end - n - 1, end - 1))
    index = torch.tensor(positions, dtype=torch.long, device=logits.device)
    return logits[0].index_select(0, index).float()


def _log_probs_and_entropy(rows: torch.Tensor, targets: torch.Tensor, args: Any, with_entropy: bool
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if parallel_state() is not None:
        return log_probs_and_entropy(rows, targets, with_entropy=with_entropy, vocab_size=args.vocab_size,
                                     group=tensor_parallel_group())
    log_p = torch.log_softmax(rows, dim=-1)
    log_probs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return log_probs, (-(log_p.exp() * log_p).sum(-1) if with_entropy else None)


def get_log_probs_and_entropy(logits: torch.Tensor, *, args: Any, unconcat_tokens: list[torch.Tensor],
                              total_lengths: list[int], response_lengths: list[int], with_entropy: bool = False,
                              non_loss_data: bool = True, top_p_token_ids: list[list[int]] | None = None,
                              top_p_token_offsets: list[list[int]] | None = None,
                              ) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """slime's call: (an empty tensor, {"log_probs": [R_i] per sample, "entropy": [R_i] per sample with
    `with_entropy`}) of softmax(logits / --rollout-temperature), differentiable."""
    who = "get_log_probs_and_entropy"
    if top_p_token_ids is not None or top_p_token_offsets is not None:
        raise ValueError(f"{who}: the rollout's top-p replay (top_p_token_ids / top_p_token_offsets) is not "
                         "implemented here; call it without them")
    rows = _response_rows(logits, total_lengths, response_lengths, who) / args.rollout_temperature
    targets = torch.cat([torch.as_tensor(tokens, device=logits.device)[len(tokens) - n:]
                         for tokens, n in zip(unconcat_tokens, response_lengths, strict=True)]).long()
    log_probs, entropy = _log_probs_and_entropy(rows, targets, args, with_entropy)
    result = {"log_probs": list(log_probs.split(list(response_lengths)))}
    if with_entropy:
        result["entropy"] = list(entropy.split(list(response_lengths)))
    return torch.empty((0,), device=logits.device), result


def get_values(logits: torch.Tensor, *, args: Any, unconcat_tokens: list[torch.Tensor], total_lengths: list[int],
               response_lengths: list[int], with_entropy: bool = False, non_loss_data: bool = True,
               ) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """slime's call: (an empty tensor, {"values": [R_i] per sample}) from a value head's `[1, T, 1]` output; the
    value of response token t is read where the token is predicted, without the rollout temperature."""
    rows = _response_rows(logits, total_lengths, response_lengths, "get_values")
    if rows.shape[-1] != 1:
        raise ValueError(f"get_values: logits with {rows.shape[-1]} outputs per position; a value head gives 1")
    return torch.empty((0,), device=logits.device), {"values": list(rows.squeeze(-1).split(list(response_lengths)))}


def _padded(per_sample: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.stack([F.pad(torch.as_tensor(x).float(), (0, width - x.shape[0])) for x in per_sample])


def policy_loss_function(args: Any, batch: dict[str, Any], logits: torch.Tensor,
                         sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor],
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's policy loss of a micro-batch dict (the keys a custom loss receives: "unconcat_tokens",
    "advantages", "log_probs", "loss_masks", "response_lengths", "total_lengths", optionally "ref_log_probs",
    "rollout_log_probs"), reduced by `sum_of_sample_mean`: (loss, {"loss", "pg_loss", "entropy_loss",
    "pg_clipfrac", "ppo_kl", ...}), micro-batch sums as slime's. The math is `policy_loss`'s."""
    lengths, totals = list(batch["response_lengths"]), list(batch["total_lengths"])
    _, current = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                           total_lengths=totals, response_lengths=lengths, with_entropy=True)
    old = batch.get("rollout_log_probs") if args.use_rollout_logprobs else batch.get("log_probs")
    if not old:
        old = [lp.detach() for lp in current["log_probs"]]
    width = max(lengths, default=0)

    def padded(key: str) -> torch.Tensor | None:
        return _padded(batch[key], width) if batch.get(key) else None

    def reduce(values: torch.Tensor) -> torch.Tensor:
        return sum_of_sample_mean(torch.cat([values[i, :n] for i, n in enumerate(lengths)]))

    inputs = LossInputs(
        log_probs=_padded(current["log_probs"], width), old_log_probs=_padded(old, width),
        advantages=padded("advantages"), mask=padded("loss_masks"), entropy=_padded(current["entropy"], width),
        ref_log_probs=padded("ref_log_probs"), rollout_log_probs=padded("rollout_log_probs"), aggregate=reduce,
        global_denominator=1.0,  # sums, as slime's
        hook_inputs=LossHookInputs(response_lengths=lengths, total_lengths=totals),  # a TIS / reducer hook's
    )
    loss, metrics = policy_loss(args, inputs)
    reported = {"loss": loss.detach()}
    reported.update({name.removeprefix("train/"): value.detach() for name, value in metrics.items()})
    return loss, reported
