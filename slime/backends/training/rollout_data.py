"""`--rollout-data-postprocess-path`: slime's `rollout_data` dict of one training rank, handed to the hook and
read back.

slime calls `fn(args, rollout_id, rollout_data)` on every training rank once the rollout's log-probs and
advantages are known and before the first optimizer step; the hook edits the dict in place (e.g. the loss
masks). `rollout_data` holds, with slime's key names, this rank's rows in training order (`partition`: their
indices in the rollout's train batch): one entry per row, per-token values as 1-D tensors of the response
length. `raw_reward` is the whole batch's (slime ships it whole). Keys whose values are not known on this rank
are absent (e.g. `log_probs` when the training forward's own are reused, advantages off the last pipeline stage).

What the hook changes in the `EDITABLE` keys it is given (in place or by assigning a new list) is what training
uses; the other keys, and keys it adds, are for reading only. The loss denominators are counted before the
hook, from the batch's loss masks: the per-step token count of --calculate-per-token-loss (assumed here) and
the per-rollout masked tokens the per-sample mean divides by (slime's `rollout_mask_sums`, counted by its rollout
manager before the hook runs), so a hook that masks tokens out takes them out of the numerators only.
"""

from __future__ import annotations

from typing import Any

import torch

from slime.backends.training.record import RolloutRecord, slime_rollout_data

# rollout_data key -> the RolloutRecord field training reads
EDITABLE = {
    "loss_masks": "loss_masks",
    "advantages": "advantages",
    "returns": "returns",
    "log_probs": "old_log_probs",
    "ref_log_probs": "ref_log_probs",
    "rollout_log_probs": "rollout_log_probs",
}
FLAG = "--rollout-data-postprocess-path"


def rollout_data_of(record: RolloutRecord) -> dict[str, Any]:
    """slime's `rollout_data` of this rank's rows (`slime_rollout_data`: copies, so editing it leaves the record
    alone until `apply_rollout_data`)."""
    return slime_rollout_data(record)


def apply_rollout_data(record: RolloutRecord, data: dict[str, Any], given: set[str], path: str) -> None:
    """Take the hook's values of the `EDITABLE` keys it was `given` back into the record (keys it adds are not
    read); errors name the hook, the key and the row."""
    rows = record.rows
    for key, field in EDITABLE.items():
        if key not in given:
            continue
        if key not in data:
            raise ValueError(f"{FLAG} {path}: the hook removed rollout_data[{key!r}], which training reads; edit "
                             "its values instead")
        values = data[key]
        if len(values) != len(rows):
            raise ValueError(f"{FLAG} {path}: rollout_data[{key!r}] has {len(values)} entries after the hook, this "
                             f"rank trains on {len(rows)} rows; keep one entry per row of rollout_data['partition']")
        old = getattr(record, field)
        updated = {}
        for i, (r, value) in enumerate(zip(rows, values)):
            tensor = torch.as_tensor(value).detach().reshape(-1)
            want = record.batch.response_lengths[r]
            if tensor.numel() != want:
                raise ValueError(f"{FLAG} {path}: rollout_data[{key!r}][{i}] (row {r}) has {tensor.numel()} values "
                                 f"after the hook; it needs one per response token ({want})")
            updated[r] = tensor.to(device=old[r].device, dtype=torch.float32)
        setattr(record, field, {**old, **updated})
