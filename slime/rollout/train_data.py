"""A rollout's samples -> the `TrainBatch` training gets, and the debug dumps of samples
(`--save-debug-rollout-data` / `--load-debug-rollout-data`).

Samples marked FAILED stay in the batch (so the batch-size identity holds and groups stay whole) but get an
all-zero loss mask: a failed generation or reward never produces a gradient.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from slime.algorithm.rewards import train_rewards
from slime.utils.types import Sample, TrainBatch

logger = logging.getLogger(__name__)


def flatten_groups(groups: Any, source: str) -> list[Sample]:
    """Groups of samples in order -> one flat list (a bare Sample counts as a group of one)."""
    if not isinstance(groups, (list, tuple)):
        raise TypeError(
            f"--rollout-function-path={source} returned {type(groups).__name__}, expected list[list[Sample]]"
        )
    flat: list[Sample] = []
    for g in groups:
        for s in [g] if isinstance(g, Sample) else g:
            if not isinstance(s, Sample):
                raise TypeError(
                    f"--rollout-function-path={source} returned a {type(s).__name__} where a Sample was expected"
                )
            flat.append(s)
    return flat


def build_train_batch(args: Any, samples: list[Sample]) -> TrainBatch:
    """Samples (in order) -> TrainBatch: rewards for training (slime/algorithm/rewards.py), loss masks (all 0
    for a FAILED sample), the engines' log-probs when every sample has them."""
    raw = [s.get_reward_value(args.reward_key) for s in samples]
    n = args.n_samples_per_prompt
    group_indices = [s.group_index if s.group_index is not None else i // n for i, s in enumerate(samples)]
    rewards = train_rewards(args, samples, raw, group_indices)

    loss_masks = []
    for s in samples:
        mask = list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length
        if len(mask) != s.response_length:
            raise ValueError(
                f"sample {s.index} (group {s.group_index}): loss_mask has {len(mask)} entries but "
                f"response_length={s.response_length}; a custom generate function must keep them equal"
            )
        loss_masks.append([0] * len(mask) if s.status == Sample.Status.FAILED else mask)

    log_probs = None
    if samples and all(s.rollout_log_probs is not None for s in samples):
        log_probs = [list(s.rollout_log_probs) for s in samples]
        for s, lp in zip(samples, log_probs):
            if len(lp) != s.response_length:
                raise ValueError(
                    f"sample {s.index} (group {s.group_index}): {len(lp)} rollout log-probs for "
                    f"response_length={s.response_length}"
                )
    return TrainBatch(
        tokens=[list(s.tokens) for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=loss_masks,
        rewards=rewards,
        raw_rewards=raw,
        truncated=[s.status == Sample.Status.TRUNCATED for s in samples],
        group_indices=group_indices,
        rollout_log_probs=log_probs,
    )


def save_debug_samples(template: str, rollout_id: int, samples: list[Sample]) -> str:
    path = template.format(rollout_id=rollout_id)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)
    logger.info("rollout %d: %d samples saved to %s", rollout_id, len(samples), path)
    return path


def load_debug_samples(template: str, rollout_id: int) -> list[Sample]:
    path = template.format(rollout_id=rollout_id)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--load-debug-rollout-data={template}: {path} does not exist for rollout {rollout_id}"
        )
    data = torch.load(path, weights_only=False)
    return [Sample.from_dict(d) for d in data["samples"]]
