"""slime's formats of a rank's per-row values, built at the edge for the hooks that receive them, and only when
one of those hooks is set.

The loss reads padded `[B, R]` tensors (`LossInputs`, slime/algorithm/loss.py) and nothing else; slime's loss
hooks read the rows in slime's layouts, which need more than the built-in losses do. What only they read is
`LossHookInputs`, built by the trainer when `loss_hooks_set(args)`:
- `--custom-tis-function-path` (with --use-tis / --get-mismatch-metrics) and `--custom-pg-loss-reducer-function-path`
  get the rows' response and total lengths and per-sample / flat tensors (`SampleLayout`);
- `--loss-type custom_loss --custom-loss-function-path` also gets slime's micro-batch dict (`loss_batch`: the
  rows' tokens, slime's `unconcat_tokens`, and with --use-opd the teacher's log-probs) and the forward's logits in
  slime's `[1, T, V]` layout.

The hooks that receive a rank's rows as slime's `rollout_data` dict (--custom-advantage-function-path,
--rollout-data-postprocess-path, and the --save-debug-train-data dump) get it from `rollout_data`, built when they
run; the advantage step itself reads `AdvantageInputs` (slime/algorithm/estimators.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from slime.utils.hooks import hooks_of


@dataclass
class LossHookInputs:
    """What only slime's loss hooks read of a micro-batch, besides its `LossInputs`."""

    response_lengths: list[int]
    total_lengths: list[int]  # prompt + response tokens per row
    tokens: list[torch.Tensor] | None = None  # each row's prompt + response tokens (slime's unconcat_tokens)
    logits: torch.Tensor | None = None  # the forward's logits, [1, T, V(/tp)]: the rows back to back (a custom loss)
    teacher_log_probs: torch.Tensor | None = None  # [B, R], --use-opd: the teacher's (a custom loss's batch)


def loss_hooks_set(args: Any) -> bool:
    """Whether a loss hook that reads `LossHookInputs` runs: a custom loss, a custom TIS function (called with
    --use-tis or --get-mismatch-metrics) or a custom pg-loss reducer."""
    hooks = hooks_of(args)
    return (args.loss_type == "custom_loss"
            or (hooks.custom_tis_function is not None and (args.use_tis or args.get_mismatch_metrics))
            or hooks.custom_pg_loss_reducer_function is not None)


class SampleLayout:
    """Conversions between the padded `[B, R]` rows of a micro-batch (`inputs`, a `LossInputs`) and slime's
    layouts: per-sample lists of [T_i] tensors and their flat concatenation (differentiable both ways)."""

    def __init__(self, inputs: Any, needed_by: str):
        self.needed_by = needed_by
        self._inputs = inputs
        hook_inputs = inputs.hook_inputs
        if hook_inputs is None:
            raise ValueError(f"{needed_by}: the training backend passed no LossInputs.hook_inputs (the rows' "
                             "response_lengths, total_lengths, ...), which slime's hook contract needs "
                             "(slime/backends/training/record.py builds them when `loss_hooks_set(args)`)")
        self.lengths = list(hook_inputs.response_lengths)
        self.total_lengths = list(hook_inputs.total_lengths)
        self.width = inputs.mask.shape[1]

    @property
    def denominator(self) -> float:
        """What a micro-batch sum is divided by to become this micro-batch's share of the global value."""
        if self._inputs.global_denominator is None:
            raise ValueError(f"{self.needed_by}: the training backend passed no LossInputs.global_denominator, which "
                             "slime's hook contract needs (slime/backends/training/record.py builds LossInputs)")
        return float(self._inputs.global_denominator)

    def rows(self, padded: torch.Tensor) -> list[torch.Tensor]:
        return [padded[i, :n] for i, n in enumerate(self.lengths)]

    def flat(self, padded: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.rows(padded))

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] != sum(self.lengths):
            raise ValueError(f"a flat per-token tensor has {flat.shape[0]} entries; this micro-batch has "
                             f"{sum(self.lengths)} response tokens ({self.lengths})")
        return torch.stack([F.pad(x, (0, self.width - n)) for x, n in zip(flat.split(self.lengths), self.lengths)])


def loss_batch(inputs: Any, layout: SampleLayout) -> dict[str, Any]:
    """slime's micro-batch dict for a custom loss, one [T_i] tensor per sample: "unconcat_tokens" (prompt +
    response, for slime's `get_log_probs_and_entropy(logits, ...)` at slime.backends.megatron_utils.loss),
    "advantages", "log_probs" (the old policy's), "ref_log_probs" / "rollout_log_probs" (None where absent),
    "loss_masks", "response_lengths", "total_lengths", "rollout_mask_sums" ([B], when known), with --use-opd
    "teacher_log_probs" and "opd_reverse_kl"; and ours, computed by the trainer from the logits at the rollout
    temperature: "cur_log_probs" and "entropy" (the current policy's, with gradient)."""
    def rows(x):
        return None if x is None else layout.rows(x)
    hook_inputs = inputs.hook_inputs
    batch = {
        "unconcat_tokens": hook_inputs.tokens,
        "advantages": rows(inputs.advantages), "log_probs": rows(inputs.old_log_probs),
        "ref_log_probs": rows(inputs.ref_log_probs), "rollout_log_probs": rows(inputs.rollout_log_probs),
        "loss_masks": rows(inputs.mask), "response_lengths": layout.lengths, "total_lengths": layout.total_lengths,
        "cur_log_probs": rows(inputs.log_probs), "entropy": rows(inputs.entropy),
    }
    if inputs.sample_denominators is not None:
        batch["rollout_mask_sums"] = inputs.sample_denominators
    if inputs.opd_reverse_kl is not None:
        batch["teacher_log_probs"] = rows(hook_inputs.teacher_log_probs)
        batch["opd_reverse_kl"] = rows(inputs.opd_reverse_kl)
    return batch


def rollout_data(*, response_lengths: list[int], rewards: list[float], loss_masks: list[torch.Tensor],
                 total_lengths: list[int] | None = None, partition: list[int] | None = None,
                 tokens: list[torch.Tensor] | None = None, raw_reward: list[float] | None = None,
                 truncated: list[int] | None = None, kl: list[torch.Tensor] | None = None,
                 values: list[torch.Tensor] | None = None, log_probs: list[torch.Tensor] | None = None,
                 ref_log_probs: list[torch.Tensor] | None = None, rollout_log_probs: list[torch.Tensor] | None = None,
                 advantages: list[torch.Tensor] | None = None, returns: list[torch.Tensor] | None = None,
                 group_indices: list[int] | None = None, teacher_log_probs: list[torch.Tensor] | None = None,
                 entropies: dict[str, list[torch.Tensor]] | None = None) -> dict[str, Any]:
    """slime's `rollout_data` dict of a rank's rows (fresh lists), as --custom-advantage-function-path and
    --rollout-data-postprocess-path receive it, with slime's keys and dtypes: "partition" (the rows' indices in the
    rollout's train batch), "tokens" (prompt + response), "response_lengths", "total_lengths", "rewards",
    "raw_reward" (the whole train batch's, as slime ships it), "truncated", "loss_masks" (int), "kl" (given by the
    advantage step: zeros without --kl-coef, as in slime), "values", "log_probs" (the old policy's),
    "ref_log_probs", "rollout_log_probs", "teacher_log_probs" (--use-opd), "advantages", "returns", and ours
    "group_indices"; with --use-rollout-entropy "entropy" / "ref_entropy" / "teacher_entropy" (`entropies`: per
    token, of each log-prob pass that ran). A key whose values are not given is absent, as in slime's dict."""
    data = {
        "partition": partition, "tokens": tokens, "response_lengths": response_lengths,
        "total_lengths": total_lengths, "rewards": rewards, "raw_reward": raw_reward,
        "truncated": truncated, "loss_masks": [m.to(torch.int) for m in loss_masks], "kl": kl,
        "values": values, "log_probs": log_probs, "ref_log_probs": ref_log_probs,
        "rollout_log_probs": rollout_log_probs, "advantages": advantages, "returns": returns,
        "group_indices": group_indices, "teacher_log_probs": teacher_log_probs,
        **(entropies or {}),
    }
    return {key: list(value) for key, value in data.items() if value is not None}
