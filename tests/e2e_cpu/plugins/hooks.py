"""The hooks around the default rollout, each written to slime's documented signature:
`--rollout-sample-hook-path`, `--rollout-sample-filter-path`, `--rollout-all-samples-process-path`,
`--custom-convert-samples-to-train-data-path`, `--custom-rollout-log-function-path`,
`--custom-eval-rollout-log-function-path`; and a `--data-source-path` class (slime's `DataSource`)."""

from __future__ import annotations

import copy

from slime.rollout.data_source import DataSource
from slime.utils.types import Sample

from tests.e2e_cpu.plugins.record import record


def tag_sample(args, sample: Sample, *, rollout_id=None, evaluation=False) -> Sample:
    """Runs on every generated sample before its reward."""
    sample.metadata["hook"] = {"rollout_id": rollout_id, "evaluation": evaluation}
    return sample


def leave_out_unsearched(args, groups: list[list[Sample]]) -> None:
    """Samples that never called the search tool take no part in the loss."""
    for group in groups:
        for sample in group:
            sample.remove_sample = sample.metadata.get("searches", 0) == 0
    record("sample_filter", groups=[[s.index for s in g] for g in groups])


def record_all_groups(args, all_groups: list[list[Sample]], data_source) -> None:
    record("all_samples", groups=len(all_groups), source=type(data_source).__name__,
           rewards=[[s.reward for s in g] for g in all_groups])


def to_train_data(args, samples: list[Sample]) -> dict:
    """Dr.GRPO-style rewards (minus the group mean, no std) in slime's train-data dict."""
    by_group: dict[int, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group_index, []).append(s.reward)
    means = {g: sum(r) / len(r) for g, r in by_group.items()}
    record("convert", samples=len(samples), removed=sum(s.remove_sample for s in samples))
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [s.reward - means[s.group_index] for s in samples],
        "raw_reward": [s.reward for s in samples],
        "truncated": [1 if s.status == Sample.Status.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "loss_masks": [[0] * s.response_length if s.remove_sample else s.loss_mask for s in samples],
        "rollout_log_probs": [s.rollout_log_probs for s in samples],
    }


def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    record("rollout_log", rollout_id=rollout_id, samples=len(samples), metrics=sorted(rollout_extra_metrics or {}),
           rollout_time=rollout_time, hooks=[s.metadata.get("hook") for s in samples])
    return False  # keep the default logging too


def log_eval(rollout_id, args, data, extra_metrics) -> bool:
    record("eval_log", rollout_id=rollout_id, datasets=sorted(data),
           rewards={name: d["rewards"] for name, d in data.items()})
    return False


class CountingDataSource(DataSource):
    """Prompts of the toy task made on the fly ("what comes after N?"), numbered as slime's data source numbers
    them; it keeps handed-back groups in a buffer and checkpoints its counter."""

    def __init__(self, args):
        self.args = args
        self.next_prompt = 0
        self.next_index = 0
        self.buffer: list[list[Sample]] = []

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups, self.buffer = self.buffer[:num_samples], self.buffer[num_samples:]
        while len(groups) < num_samples:
            n = self.next_prompt % 9
            prompt = Sample(prompt=f"what comes after {n}?", label=str(n + 1))
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index, sample.index = self.next_prompt, self.next_index
                self.next_index += 1
                group.append(sample)
            self.next_prompt += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        self.buffer.extend(samples)

    def save(self, rollout_id) -> None:
        record("data_source_save", rollout_id=rollout_id, next_prompt=self.next_prompt)

    def load(self, rollout_id=None) -> None:
        pass

    def __len__(self) -> int:
        return 9
