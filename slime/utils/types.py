"""Typed contracts that cross process boundaries: `Sample` (rollout side) and `TrainBatch` (rollout → training)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    """One prompt + response. Tokens hold prompt and response ids; `loss_mask` and
    `rollout_log_probs` have one entry per response token."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    weight_versions: list[str] = field(default_factory=list)
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    multimodal_inputs: dict[str, Any] | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        d = dict(d)
        d["status"] = cls.Status(d.get("status", cls.Status.PENDING.value))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"Sample.from_dict: unknown fields {sorted(unknown)}")
        return cls(**d)

    def get_reward_value(self, reward_key: str | None) -> float:
        """The scalar reward; with a dict reward, `reward_key` (--reward-key) picks the entry."""
        if isinstance(self.reward, dict):
            if not reward_key:
                raise ValueError(
                    f"sample {self.index}: reward is a dict with keys {sorted(self.reward)}; "
                    "pass --reward-key to choose the scalar to train on"
                )
            return float(self.reward[reward_key])
        return float(self.reward if self.reward is not None else 0.0)


@dataclass
class TrainBatch:
    """What the rollout manager hands to training for one rollout: flat, ordered by (group_index, index).

    `rewards` are the values advantages are computed from (already group-normalised for GRPO-like
    estimators); `raw_rewards` are the reward function's values, for logging.
    """

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    rewards: list[float]
    raw_rewards: list[float]
    truncated: list[bool]
    group_indices: list[int]
    rollout_log_probs: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("response_lengths", "loss_masks", "rewards", "raw_rewards", "truncated", "group_indices"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries, tokens has {n}")
        for i, (mask, rl) in enumerate(zip(self.loss_masks, self.response_lengths)):
            if len(mask) != rl:
                raise ValueError(f"TrainBatch sample {i}: loss_mask has {len(mask)} entries, response_length={rl}")

    def select(self, indices: list[int]) -> "TrainBatch":
        """A new batch holding the given rows, in the given order."""

        def pick(values):
            return None if values is None else [values[i] for i in indices]

        return TrainBatch(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)})
