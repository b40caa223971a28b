"""What a dynamic-sampling filter (`--dynamic-sampling-filter-path fn(args, group)`) returns: a bool, or a
`DynamicFilterOutput` that also says why a group was dropped (counted as `rollout/dynamic_filter/drop_<reason>`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None
