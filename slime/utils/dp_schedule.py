"""slime's `slime.utils.dp_schedule`: `build_dp_schedule`, re-exported from slime/backends/training/schedule.py
(its implementation and documentation: the trainers' own batching answers slime's call).

A facade for plugins and scripts only: no module of `slime/` imports it (tests/unit/test_layers.py checks this).
The name is an alias of the home module (`sys.modules`), so what a plugin or a test sets on it is what the code
reads.
"""

from __future__ import annotations

import sys

from slime.backends.training import schedule

from slime.backends.training.schedule import build_dp_schedule

__all__ = ["build_dp_schedule"]

sys.modules[__name__] = schedule
