"""What a dynamic-sampling filter returns and how the rollout reads it.

    --dynamic-sampling-filter-path: fn(args, samples, **kwargs) -> DynamicFilterOutput | bool

A filter judges one finished group. `DynamicFilterOutput.reason` names why a group was dropped (counted as
`rollout/dynamic_filter/drop_<reason>`); `keep_when_insufficient` asks the rollout to keep a rejected group
anyway when dropping it would leave fewer groups (kept + still generating) than `--rollout-batch-size`, so a
strict filter does not cost another round of over-sampling. A plain bool is read as `keep`, and so is the
`keep` of an object shaped like `DynamicFilterOutput`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def call_dynamic_filter(fn: Callable | None, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    """Call a filter (`None`: keep everything) and give its verdict the typed shape; `keep` becomes a bool (a
    filter may answer with a numpy or torch boolean)."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    if isinstance(output, DynamicFilterOutput):
        output.keep = bool(output.keep)
        return output
    if hasattr(output, "keep"):  # an object of the same shape (a filter written against its own copy of the type)
        return DynamicFilterOutput(keep=bool(output.keep), reason=getattr(output, "reason", None),
                                   keep_when_insufficient=bool(getattr(output, "keep_when_insufficient", False)))
    if output is None or isinstance(output, (str, dict, list, tuple)):
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"--dynamic-sampling-filter-path {name} returned {type(output).__name__}; return a bool or "
                        "DynamicFilterOutput(keep=..., reason=...) (slime.rollout.filter_hub.base_types)")
    return DynamicFilterOutput(keep=bool(output))


def should_drop_dynamic_filter_output(output: DynamicFilterOutput, *, remaining_batch_size: int,
                                      target_data_size: int) -> bool:
    """Whether the rollout drops a judged group. `remaining_batch_size`: groups still able to fill the batch
    (kept, generating, and this one); `target_data_size`: the groups the batch needs."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


def drop_metric(reason: str | None) -> str:
    """The counter a dropped group adds 1 to: `rollout/dynamic_filter/drop_<reason>` (`filtered` without one)."""
    return f"rollout/dynamic_filter/drop_{reason or 'filtered'}"


class MetricGatherer:
    """Counts the groups a rollout's filter dropped, per reason; `collect()` gives them as metrics."""

    def __init__(self) -> None:
        self._drops: dict[str, int] = {}

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        key = drop_metric(reason)
        self._drops[key] = self._drops.get(key, 0) + 1

    def collect(self) -> dict[str, int]:
        return dict(self._drops)
