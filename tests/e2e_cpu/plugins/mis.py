"""A masked-importance-sampling TIS function, written to the contract of slime's train_infer_mismatch_helper
example (`--use-tis --custom-tis-function-path ... --custom-config-path mis.yaml`): the per-token ratio of the
trainer's to the engine's probabilities; tokens outside [tis_lower_bound, tis_upper_bound] (keys of the YAML,
which slime sets on args) leave the loss masks, the rest are weighted by the ratio."""

from __future__ import annotations

import torch

from tests.e2e_cpu.plugins.record import record


def masked_is(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
              **kwargs):
    lower, upper = args.tis_lower_bound, args.tis_upper_bound
    weights, masks, rejected = [], [], []
    for train, rollout, mask in zip(train_log_probs, rollout_log_probs, loss_masks):
        ratio = torch.exp(train - rollout).detach()
        keep = ((ratio >= lower) & (ratio <= upper)).to(mask.dtype)
        weights.append(ratio * keep)
        masks.append(mask * keep)
        rejected.append((1 - keep) * mask)
    record("mis", mode=args.tis_mode, samples=len(response_lengths), tokens=int(sum(response_lengths)),
           rejected=float(torch.cat(rejected).sum()), extra=sorted(kwargs))
    return pg_loss * torch.cat(weights), masks, {"mis_rejected": torch.cat(rejected)}
