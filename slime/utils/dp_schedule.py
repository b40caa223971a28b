"""slime's `slime.utils.dp_schedule`: `build_dp_schedule`, re-exported from slime/backends/training/schedule.py
(its implementation and documentation: the trainers' own batching answers slime's call).

A facade for plugins and scripts only: no module of `slime/` imports it (tests/unit/test_layers.py checks this).
"""

from __future__ import annotations

from slime.backends.training.schedule import build_dp_schedule

__all__ = ["build_dp_schedule"]
