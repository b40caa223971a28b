"""A rollout's samples -> the `TrainBatch` training gets, and the debug dumps of samples
(`--save-debug-rollout-data` / `--load-debug-rollout-data`, optionally subsampled by
`--load-debug-rollout-data-subsample`).

Samples marked FAILED stay in the batch (so the batch-size identity holds and groups stay whole) but get an
all-zero loss mask: a failed generation or reward never produces a gradient. So do samples a
`--rollout-sample-filter-path` marked `remove_sample` (they still take part in the group's reward
normalisation, as in slime).

`--custom-convert-samples-to-train-data-path fn(args, samples) -> dict` replaces the conversion; its dict
(slime's train data: tokens, response_lengths, rewards, raw_reward, truncated, loss_masks, optionally
rollout_log_probs, teacher_log_probs and rollout_ids, else the samples' `rollout_ids`) is read into the `TrainBatch`
(`train_batch_from_dict`); the group of each row is its sample's. Keys this trainer has no use for
(sample_indices, round_number, metadata, ...) are logged once and not used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from slime.algorithm.rewards import rollout_rewards
from slime.utils.hooks import hooks_of
from slime.utils.types import Sample, TrainBatch

logger = logging.getLogger(__name__)


CONVERT_FLAG = "--custom-convert-samples-to-train-data-path"
_REQUIRED_KEYS = ("tokens", "response_lengths", "rewards", "raw_reward", "truncated", "loss_masks")
_USED_KEYS = set(_REQUIRED_KEYS) | {"rollout_log_probs", "rollout_ids", "teacher_log_probs"}
_unused_keys_logged: set[str] = set()


def flatten_groups(groups: Any, source: str) -> list[Sample]:
    """Groups of samples in order -> one flat list. A bare Sample counts as a group of one; a group may nest
    lists (slime's shape for several samples split from one prompt's rollout), walked in order."""
    if not isinstance(groups, (list, tuple)):
        raise TypeError(
            f"--rollout-function-path={source} returned {type(groups).__name__}, expected list[list[Sample]]"
        )
    flat: list[Sample] = []

    def walk(node: Any) -> None:
        if isinstance(node, Sample):
            flat.append(node)
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
        else:
            raise TypeError(
                f"--rollout-function-path={source} returned a {type(node).__name__} where a Sample was expected"
            )

    for g in groups:
        walk(g)
    return flat


def rollout_ids(samples: list[Sample]) -> list[int]:
    """The rollout of each sample (`TrainBatch.rollout_ids`): samples sharing a `rollout_id` came from one rollout
    (a custom generate that split it); a sample without one is a rollout of its own, given the smallest id no
    other sample holds (slime's rule)."""
    ids = [s.rollout_id for s in samples]
    taken = {i for i in ids if i is not None}
    fresh = 0
    for k, rid in enumerate(ids):
        if rid is None:
            while fresh in taken:
                fresh += 1
            ids[k] = fresh
            taken.add(fresh)
    return ids


def rollout_count(samples: list[Sample]) -> int:
    """How many rollouts (prompt x sample executions) `samples` hold (see `rollout_ids`)."""
    return len(set(rollout_ids(samples)))


def samples_to_train_batch(args: Any, samples: list[Sample]) -> TrainBatch:
    """The rollout's samples -> TrainBatch: `--custom-convert-samples-to-train-data-path` when set (its dict read
    by `train_batch_from_dict`), else `build_train_batch`."""
    path = args.custom_convert_samples_to_train_data_path
    if not path:
        return build_train_batch(args, samples)
    data = hooks_of(args).custom_convert_samples_to_train_data(args, samples)
    return train_batch_from_dict(data, samples, f"{CONVERT_FLAG}={path}", args.n_samples_per_prompt)


def train_batch_from_dict(data: Any, samples: list[Sample], where: str, n_samples_per_prompt: int) -> TrainBatch:
    """slime's train-data dict (one entry per sample in each list) -> TrainBatch; errors name the key. A row's
    group is its sample's `group_index` (else its position // n_samples_per_prompt)."""
    if isinstance(data, TrainBatch):
        return data
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} returned {type(data).__name__}; return a dict with the keys {list(_REQUIRED_KEYS)}")
    missing = [k for k in _REQUIRED_KEYS if k not in data]
    if missing:
        raise KeyError(f"{where} returned a dict without {missing} (it has {sorted(data)}); every one of "
                       f"{list(_REQUIRED_KEYS)} is needed, one entry per sample")
    n = len(samples)
    for key in _USED_KEYS & set(data):
        if data[key] is not None and len(data[key]) != n:
            raise ValueError(f"{where}: '{key}' has {len(data[key])} entries for {n} samples")
    unused = sorted(set(data) - _USED_KEYS - _unused_keys_logged)
    if unused:
        _unused_keys_logged.update(unused)
        logger.info("%s: keys %s are not used by this trainer", where, unused)
    log_probs, teacher = data.get("rollout_log_probs"), data.get("teacher_log_probs")
    ids = data.get("rollout_ids")
    return TrainBatch(
        tokens=[[int(t) for t in row] for row in data["tokens"]],
        response_lengths=[int(x) for x in data["response_lengths"]],
        loss_masks=[[int(m) for m in row] for row in data["loss_masks"]],
        rewards=[float(x) for x in data["rewards"]],
        raw_rewards=[float(x) for x in data["raw_reward"]],
        truncated=[bool(x) for x in data["truncated"]],
        group_indices=_group_indices(samples, n_samples_per_prompt),
        rollout_log_probs=None if log_probs is None else [[float(x) for x in row] for row in log_probs],
        rollout_ids=rollout_ids(samples) if ids is None else [int(x) for x in ids],
        teacher_log_probs=None if teacher is None else [_floats(row) for row in teacher],
        policy_versions=[s.policy_version for s in samples],
    )


def _floats(values) -> list[float]:
    """A per-token row (list or tensor) as floats."""
    return [float(x) for x in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def _group_indices(samples: list[Sample], n_samples_per_prompt: int) -> list[int]:
    return [s.group_index if s.group_index is not None else i // n_samples_per_prompt for i, s in enumerate(samples)]


def build_train_batch(args: Any, samples: list[Sample]) -> TrainBatch:
    """Samples (in order) -> TrainBatch: rewards for training (slime/algorithm/rewards.py), loss masks (all 0
    for a FAILED sample and one marked `remove_sample`), the engines' log-probs when every sample has them, the
    teacher's (on-policy distillation) when the samples have them."""
    group_indices = _group_indices(samples, args.n_samples_per_prompt)
    raw, rewards = rollout_rewards(args, samples, group_indices)

    loss_masks = []
    for s in samples:
        mask = list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length
        if len(mask) != s.response_length:
            raise ValueError(
                f"sample {s.index} (group {s.group_index}): loss_mask has {len(mask)} entries but "
                f"response_length={s.response_length}; a custom generate function must keep them equal"
            )
        loss_masks.append([0] * len(mask) if s.status == Sample.Status.FAILED or s.remove_sample else mask)

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
        rollout_ids=rollout_ids(samples),
        teacher_log_probs=teacher_log_probs(samples),
        policy_versions=[s.policy_version for s in samples],
        token_policy_versions=token_policy_versions(samples),
        multimodal_train_inputs=multimodal_train_inputs(samples),
    )


def multimodal_train_inputs(samples: list[Sample]) -> list[dict | None] | None:
    """Each sample's processed images (`Sample.multimodal_train_inputs`), when any sample has them."""
    rows = [s.multimodal_train_inputs or None for s in samples]
    return rows if any(r is not None for r in rows) else None


def token_policy_versions(samples: list[Sample]) -> list[list[int]] | None:
    """Each sample's per-token weight versions, when every sample has one per response token (else None: the
    staleness metrics then count a row's tokens at its `policy_version`)."""
    rows = [s.token_policy_versions for s in samples]
    if not samples or any(r is None or len(r) != s.response_length for r, s in zip(rows, samples)):
        return None
    return [[int(v) for v in r] for r in rows]


def teacher_log_probs(samples: list[Sample]) -> list[list[float]] | None:
    """Every sample's `teacher_log_probs` (one per response token), or None when none has them."""
    have = [s.teacher_log_probs is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        missing = [s.index for s, h in zip(samples, have) if not h]
        raise ValueError(f"samples {missing[:8]} have no teacher_log_probs but others do; on-policy distillation "
                         "needs them on every sample (the reward post-process fills them)")
    return [_floats(s.teacher_log_probs) for s in samples]  # their lengths: checked by TrainBatch


def save_debug_samples(template: str, rollout_id: int, samples: list[Sample]) -> str:
    path = template.format(rollout_id=rollout_id)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)
    logger.info("rollout %d: %d samples saved to %s", rollout_id, len(samples), path)
    return path


def save_debug_eval_samples(template: str, rollout_id: int, data: Mapping[str, Any]) -> str:
    """An eval's samples, every dataset's in the eval output's order, to `template` with `{rollout_id}` as
    `eval_<rollout_id>` (slime's name and layout: `{"rollout_id": <int>, "samples": [Sample.to_dict()]}`)."""
    samples = [s for result in data.values() for s in result.get("samples") or []]
    path = template.format(rollout_id=f"eval_{rollout_id}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)
    logger.info("eval at rollout %d: %d samples of %s saved to %s", rollout_id, len(samples), sorted(data), path)
    return path


def load_debug_samples(template: str, rollout_id: int) -> list[Sample]:
    path = template.format(rollout_id=rollout_id)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--load-debug-rollout-data={template}: {path} does not exist for rollout {rollout_id}"
        )
    data = torch.load(path, weights_only=False)
    return [Sample.from_dict(d) for d in data["samples"]]


def replayed_samples(args: Any, rollout_id: int) -> list[Sample]:
    """Rollout `rollout_id`'s samples from `--load-debug-rollout-data`; with `--load-debug-rollout-data-subsample`
    a part of them (`subsample_debug_samples`), cut to whole optimizer steps (`trim_to_whole_steps`)."""
    samples = load_debug_samples(args.load_debug_rollout_data, rollout_id)
    ratio = args.load_debug_rollout_data_subsample
    if ratio is None:
        return samples
    where = f"rollout {rollout_id} ({args.load_debug_rollout_data.format(rollout_id=rollout_id)})"
    try:
        kept = trim_to_whole_steps(subsample_debug_samples(samples, ratio), args.global_batch_size)
    except ValueError as e:
        raise ValueError(f"{where}: {e}; --load-debug-rollout-data-subsample {ratio} of {len(samples)} samples") from e
    logger.info("%s: --load-debug-rollout-data-subsample %s keeps %d of %d samples", where, ratio, len(kept),
                len(samples))
    return kept


def subsample_debug_samples(samples: list[Sample], ratio: float) -> list[Sample]:
    """`--load-debug-rollout-data-subsample`: keep `int(len(samples) * ratio)` rows, the first half of them from
    the start of the dump and the rest from its end (a row count, not groups: a group at either cut is kept in
    part). A ratio that keeps no row is an error (there would be nothing to train on)."""
    keep = int(len(samples) * ratio)
    if keep == 0:
        raise ValueError(f"--load-debug-rollout-data-subsample {ratio} keeps int({len(samples)} x {ratio}) = 0 of the "
                         f"{len(samples)} saved samples; raise it")
    head = keep // 2
    return samples[:head] + samples[len(samples) - (keep - head):]


def trim_to_whole_steps(samples: list[Sample], global_batch_size: int) -> list[Sample]:
    """The samples of the first `global_batch_size` x k rollouts (in order of first appearance; `rollout_ids`),
    the largest k: the rollouts past the last whole optimizer step are dropped (the trainer's step schedule
    would never train them). An error when not even one step is left."""
    ids = rollout_ids(samples)
    order = list(dict.fromkeys(ids))
    kept = set(order[: len(order) // global_batch_size * global_batch_size])
    if not kept:
        raise ValueError(f"{len(order)} rollouts are fewer than --global-batch-size {global_batch_size}: no optimizer "
                         "step would run")
    return [s for s, rid in zip(samples, ids) if rid in kept]
